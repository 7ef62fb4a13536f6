"""Validation: the simulator's models of one instance that prefills and decodes against
a real ``pdserve serve`` instance per schedule, replaying a window of the Mooncake
conversation trace. Chunked prefill: ``ChunkedInstanceSim``, the scheduler's steps (a
token budget of 512 shared by the decode batch and prompt pieces, a mixed step reading the
weights once: ``mixed_step_s``, plus a fixed cost per mixed step fitted on the queue probe:
``fit_mixed_step_extra``; each step planned as the previous one starts, as the engine's
overlap scheduling does). PD-multiplexing: a ``GroupSim`` of one multiplexing
instance (prompts first come first served, a decode batch beside them; beside a prompt a
decode step lasts the measured cycle, and the prompt gets what the decode step leaves of
each cycle: ``Multiplexing.cycle_s``).

For each schedule (``--schedules``: chunked prefill with 512-token steps, PD-multiplexing):

1. start the instance (``pdserve serve MODEL SERVE_ARGS SCHEDULE_ARGS``);
2. measure it over HTTP: prefill latency of one-token completions per prompt length,
   decode steps of streamed batches, and how the two sides slow each other (decode steps
   while one ``--mix-prompt``-token prompt prefills beside ``--mix-batch`` decodes, over
   the steps before it; that prompt's latency over the fitted prefill of it alone; then
   the queue probe, ``--mix-queue`` such prompts at once beside decodes at the longer
   context). Chunked prefill: beside each probe what ``mixed_step_s`` predicts for it
   (``predicted_step_ms_during``, ``predicted_prompt_s``), the mixed step's extra cost
   fitted on the queue probe and the lone probe simulated with it as the check
   (``mixed_step_extra_s``, ``simulated_prompt_s``, ``lone_probe_over_simulated``).
   Multiplexing: the queue probe's median step is the cycle, the engine's timeline over
   the probes and the replay is kept (modes, cycles, prefill delivered per option), and
   the graph-step and floor sizes its planner runs with (``engine_planner``);
3. replay the window: trace rows with timestamps in ``[--window-start-s, + --window-s)``,
   lengths times ``--input-scale`` / ``--output-scale`` (clipped), every k-th row kept and
   arrivals compressed so that the replay lasts ``--replay-s`` with the fitted prefill
   ``--load`` busy; streamed straight to the instance;
4. simulate the same requests with the fitted model, once with the measured spread of
   service times (``ServiceNoise``) and once with medians only; multiplexing also by the
   planner model (``simulated_planner``: ``PlannerShare``, the planner's own choice among
   its options walked over the predictor it serves with and the corrections its engine
   learned over the probes, each option's pieces timed as the probes measured them, and
   what the instance delivered of the plan, fitted by replaying the queue probe on the
   instance model), and by the step model (``simulated_steps``: ``pdserve/sim/mux_steps.py``,
   the planner's whole-GPU steps over the queue, each mixed-step path at the correction
   the engine learned for it on the probes, the corrections learning as the engine's do,
   the first token a step late; it has no spatial splits nor time slices, and the
   interference record's ``step_model`` (a re-simulation's
   ``cycle_covers_every_batch.multiplex_steps``) says whether the engine ran any); and
   beside it the same timed by the probes' own steps (``simulated_steps_probe_timing``:
   each mixed step on the prefill-step graphs at a measured over profile ratio of the
   probes' graph steps nearest its decode batch, ``PROBE_TIMING_DRAWS`` draws pooled);
5. write ``OUT/sim_validate_instance.json`` (after each schedule, so a cut-short run keeps
   what it finished) and each instance's log.

The default trace is the first 600 s of the public trace (FAST'25 Mooncake,
``conversation_trace.jsonl``, github.com/kvcache-ai/Mooncake), kept in the repository.
On an H200 (about 6-8 minutes by estimate: two starts of codellama-34b, two 60 s
replays, the queue probes about 25 s each)::

    PYTHONPATH=$PWD python benchmarks/sim_validate_instance.py --out out/validation

``--smoke`` runs the same steps with the tiny model on CPU in about two minutes.

``--resimulate FILE.json`` re-runs a recorded validation's simulations offline with the
models of now (``--models-as-of eb12b7d``: as they were at the first H200 validation;
``7dad880``: the planner model as it was there) from the file's own calibration, and
prints measured vs simulated (``--out FILE.json`` keeps it): no GPU, no server::

    PYTHONPATH=$PWD python benchmarks/sim_validate_instance.py \
        --resimulate benchmarks/results/sim_validate_instance_h200_eb12b7d.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.loogle_h200 import summarise_timeline  # noqa: E402
from benchmarks.mux_whatif import settings_of, share_table  # noqa: E402
from benchmarks.sim_pd_dispatch import kv_bytes_per_token  # noqa: E402
from benchmarks.validate_sim import (  # noqa: E402
    compare,
    compare_percentiles,
    engine_timeline_since,
    ints,
    measure_decode,
    measure_prefill,
    prompt,
    spread,
    token_clock,
)
from pdserve.bench.report import check_gpu, expected_gpu, result_header, write_json  # noqa: E402
from pdserve.bench.timeline import load_engine_timeline as load_timeline  # noqa: E402
from pdserve.config import ran_explicitly  # noqa: E402
from pdserve.sched.predictor import served_predictor  # noqa: E402
from pdserve.sim.cluster import (  # noqa: E402
    GroupSim,
    LatencyModel,
    Multiplexing,
    PlannerShare,
    ServiceNoise,
    SimRequest,
)
from pdserve.sim.instance import (  # noqa: E402
    ChunkedInstanceSim,
    fit_mixed_step_grid,
    mixed_step_s,
)
from pdserve.sim.mux_steps import StepRequest, engine_timed, step_spread  # noqa: E402
from pdserve.sim.step_check import step_check  # noqa: E402
from pdserve.testing import ServeProcess, start_serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WINDOW_TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_first_600s.jsonl"
PREDICTOR = "benchmarks/results/loogle_h200/d698fcb_predictor.json"  # profiled at d698fcb
# What the planner's prompts were delivered beside decode, measured over planned, on the
# LooGLE runs' timelines, and the corrections their walks planned with (``mux_whatif.py
# --fit-share``).
SHARE_FIT = ROOT / "benchmarks" / "results" / "loogle_h200" / \
    "mux_share_fit_d698fcb_predictor.json"
SCHEDULES = {
    "chunk512": "--schedule chunked --chunk-size 512",
    "multiplex": f"--schedule multiplex --itl-slo-ms 60 --mux-predictor {PREDICTOR}",
}
SMOKE_SCHEDULES = {
    "chunk512": SCHEDULES["chunk512"],
    "multiplex": "--schedule multiplex --itl-slo-ms 60 --mux-predictor roofline",
}
SMOKE = {"model": "tiny", "serve_args": "--device cpu --dtype float32",
         "prompt_lens": [64, 256, 512], "decode_batches": [1, 2], "decode_contexts": [64],
         "repeats": 3, "input_scale": 0.02, "output_scale": 0.1, "max_input": 512,
         "max_output": 32, "replay_s": 20.0, "load": 0.3, "mix_prompt": 512, "mix_batch": 2,
         "mix_steps": 400, "mix_warmup_s": 0.3, "mix_queue": 2}


async def measure_interference(session, url: str, args, rng,
                               model: LatencyModel) -> tuple[Multiplexing, dict]:
    """Both sides beside each other: ``--mix-batch`` streams decode; once they run, one
    prompt of ``--mix-prompt`` tokens is sent. Decode's factor: the median step while
    that prompt is in flight over the median step before it; prefill's: the prompt's
    latency over the fitted model's time for it alone. Then, with ``--mix-queue`` > 1,
    the queue probe: that many such prompts at once beside the batch at the longer decode
    context, as the replay runs with prompts waiting (``queue``). The median step during
    the queue (else during the lone prompt) is multiplexing's cycle
    (``Multiplexing.cycle_s``)."""
    lone = await _probe(session, url, args, rng, 1, args.decode_contexts[0], args.mix_steps)
    mix, cycle_s = dict(lone), lone["step_ms_during"] / 1e3
    if args.mix_queue > 1:
        queue = await _probe(session, url, args, rng, args.mix_queue, args.decode_contexts[-1],
                             args.mix_steps * (1 + args.mix_queue // 2))
        cycle_s, alone_s = queue["step_ms_during"] / 1e3, queue["step_ms_before"] / 1e3
        # The cycle model's own check: what it predicts for the queue's prompts (None: the
        # decode step alone fills the cycle, outside the model).
        mix["queue"] = {**queue, "prefill_over_alone": queue["prompt_s"] / (
            args.mix_queue * model.prefill_s(args.mix_prompt)),
            "cycle_model_prefill_over_alone": cycle_s / (cycle_s - alone_s)
            if alone_s < cycle_s else None}
    factors = Multiplexing(lone["step_ms_during"] / lone["step_ms_before"],
                           lone["prompt_s"] / model.prefill_s(args.mix_prompt), cycle_s=cycle_s)
    return factors, mix


async def _probe(session, url: str, args, rng, prompts: int, context: int,
                 steps: int) -> dict:
    """``--mix-batch`` decode streams of ``context``-token prompts; after the warm-up,
    ``prompts`` prompts of ``--mix-prompt`` tokens at once. The steps before (over twice
    the prompts' time) and during them, and the time until the last one's first token."""
    body = {"model": args.model, "max_tokens": steps, "ignore_eos": True}
    streams = [asyncio.create_task(token_clock(session, url, {**body, "prompt": prompt(
        rng, context)})) for _ in range(args.mix_batch)]
    await asyncio.sleep(args.mix_warmup_s)
    sent = time.monotonic()
    await asyncio.gather(*(_one_token(session, url, args.model, prompt(rng, args.mix_prompt))
                           for _ in range(prompts)))
    done = time.monotonic()
    runs = await asyncio.gather(*streams)
    gaps = [gap for t in runs for gap in chunk_steps(t[1:])]
    before = [g for a, g in gaps if a + g <= sent and a >= sent - 2 * (done - sent)]
    during = [g for a, g in gaps if a + g > sent and a < done]
    if len(before) < 3 or not during:
        raise RuntimeError(f"the decode streams did not cover the prompts ({len(before)} "
                           f"steps before, {len(during)} during): raise --mix-steps")
    return {"prompts": prompts, "decode_context": context, "prompt_s": done - sent,
            "steps_before": len(before), "steps_during": len(during),
            "step_ms_before": float(np.median(before)) * 1e3,
            "step_ms_during": float(np.median(during)) * 1e3}


async def _one_token(session, url: str, model: str, text: str) -> None:
    async with session.post(url, json={"model": model, "max_tokens": 1,
                                       "prompt": text}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        await resp.read()


def chunked_probe_prediction(model: LatencyModel, args, probe: dict) -> dict:
    """What ``mixed_step_s`` predicts for a probe (``_probe``) on a chunked instance: its
    prompts go first come first served in pieces that fill the step's budget of 512 beside
    the decode batch, whose requests hold their prompt plus the tokens decoded by then (the
    warm-up over the step before). The next GPU run checks the model by these figures
    against the measured ``step_ms_during`` and ``prompt_s``."""
    batch = args.mix_batch
    context = batch * (probe["decode_context"]
                       + round(args.mix_warmup_s / (probe["step_ms_before"] / 1e3)))
    prompts, steps = [0] * probe["prompts"], []
    while prompts[-1] < args.mix_prompt:
        steps.append(mixed_step_s(model, batch, context, _budget_pieces(
            prompts, args.mix_prompt, 512 - batch)))
        context += batch
    return {"predicted_step_ms_during": float(np.median(steps)) * 1e3,
            "predicted_prompt_s": float(sum(steps)) + model.prefill_base_s}


def simulated_probe_s(model: LatencyModel, args, probe: dict, mixed_extra_s: float,
                      decode_steps: int) -> float:
    """The probe (``_probe``) replayed on the chunked instance model: ``--mix-batch``
    requests of the probe's decode context at 0, decoding ``decode_steps`` tokens, and its
    prompts at ``--mix-warmup-s``; the time from then until the last prompt's first token,
    as ``prompt_s`` measures it. Unlike ``chunked_probe_prediction`` it keeps what is left of
    the decode requests' own prompts when the probe's arrive (the queue probe's 8 x 4K
    prompts take longer than the warm-up)."""
    decodes = [SimRequest(0.0, probe["decode_context"], decode_steps)
               for _ in range(args.mix_batch)]
    prompts = [SimRequest(args.mix_warmup_s, args.mix_prompt, 1)
               for _ in range(probe["prompts"])]
    ChunkedInstanceSim(model, chunk_size=512, mixed_step_extra_s=mixed_extra_s,
                       overlap=True).run(decodes + prompts)
    return max(float(r.first_token or 0.0) for r in prompts) - args.mix_warmup_s


def fit_mixed_step_extra(model: LatencyModel, args, interference: dict) -> tuple[float, dict]:
    """What a step carrying prompt pieces beside decodes costs on the instance beyond
    ``mixed_step_s`` (fitted on steps apart: prefill alone and decode alone): the fixed
    cost per mixed step that makes the queue probe's simulated prompt time its measured
    one (zero where the model is already as slow). The queue probe, not the lone one: it
    runs after the lone probe, as the replay does, so a fresh server's first large mixed
    steps (kernels built on first use) are behind it, and its ~600 steps pin the cost
    where one prompt's 17 do not. The lone probe is the check (``simulated_prompt_s``
    against its measured ``prompt_s``; ``lone_probe_over_simulated``). A run with the lone
    probe only: fitted on that one; without either (eb12b7d's chunked schedule): zero."""
    if "prompt_s" not in interference:
        return 0.0, {}
    queue = interference.get("queue")
    queue_steps = args.mix_steps * (1 + args.mix_queue // 2)

    def lone_s(extra_s: float) -> float:
        return simulated_probe_s(model, args, interference, extra_s, args.mix_steps)

    def queue_s(extra_s: float) -> float:
        return simulated_probe_s(model, args, queue, extra_s, queue_steps)

    if queue is None:
        extra_s = solve_increasing(lone_s, interference["prompt_s"])
        return extra_s, {"fitted_on": "lone probe", "simulated_prompt_s": lone_s(extra_s)}
    extra_s = solve_increasing(queue_s, queue["prompt_s"])
    lone = lone_s(extra_s)
    return extra_s, {"fitted_on": "queue probe", "queue_simulated_prompt_s": queue_s(extra_s),
                     "simulated_prompt_s": lone,
                     "lone_probe_over_simulated": interference["prompt_s"] / lone}


def solve_increasing(f: Callable[[float], float], target: float,
                     tolerance: float = 1e-6) -> float:
    """The x >= 0 where the increasing ``f`` reaches ``target`` (bisection); 0 where
    ``f(0)`` is already there."""
    if f(0.0) >= target:
        return 0.0
    low, high = 0.0, 1e-3
    while f(high) < target:
        low, high = high, high * 2
        if high > 10.0:
            raise SystemExit(f"no cost up to 10 s a step reaches {target:.3f} s")
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if f(middle) < target else (low, middle)
    return (low + high) / 2


def _budget_pieces(done: list[int], length: int, budget: int) -> list[tuple[int, int]]:
    """This step's pieces of the prompts (``done``: tokens each has had, updated)."""
    pieces = []
    for i, tokens in enumerate(done):
        take = min(budget, length - tokens)
        if take > 0:
            pieces.append((tokens, take))
            done[i], budget = tokens + take, budget - take
        if budget == 0:
            break
    return pieces


def chunk_steps(times: list[float]) -> list[tuple[float, float]]:
    """(start, step) per streamed chunk after the first: the time since the previous chunk
    over the tokens the chunk carries (one chunk can carry several, see ``token_clock``)."""
    arrivals = sorted(Counter(times).items())
    return [(a, (b - a) / count) for (a, _), (b, count) in zip(arrivals, arrivals[1:],
                                                                  strict=False)]


def window_requests(args, model: LatencyModel) -> tuple[list[SimRequest], dict]:
    """The trace window, rescaled (see the module docstring)."""
    start_ms, end_ms = args.window_start_s * 1e3, (args.window_start_s + args.window_s) * 1e3
    rows = [row for row in map(json.loads, open(args.trace))
            if start_ms <= row["timestamp"] < end_ms]
    if not rows:
        raise SystemExit(f"no rows of {args.trace} in the window")
    inputs = [int(np.clip(round(r["input_length"] * args.input_scale), 16, args.max_input))
              for r in rows]
    outputs = [int(np.clip(round(r["output_length"] * args.output_scale), 2, args.max_output))
               for r in rows]
    work_s = sum(model.prefill_s(n) for n in inputs)
    every = max(1, round(work_s / (args.load * args.replay_s)))
    time_scale = args.replay_s / args.window_s
    requests = [SimRequest((rows[i]["timestamp"] - start_ms) / 1e3 * time_scale, inputs[i],
                           outputs[i]) for i in range(0, len(rows), every)]
    return requests, {"trace": os.path.relpath(args.trace, ROOT),
                      "window_s": [args.window_start_s, args.window_start_s + args.window_s],
                      "rows_in_window": len(rows), "every_kth_row": every,
                      "time_scale": time_scale, "requests": len(requests),
                      "fitted_prefill_load": sum(model.prefill_s(r.input_len)
                                                 for r in requests) / args.replay_s,
                      "mean_input": float(np.mean([r.input_len for r in requests])),
                      "mean_output": float(np.mean([r.output_len for r in requests]))}


async def replay(session, url: str, requests: list[SimRequest], args, rng) -> list[dict]:
    start = time.monotonic()

    async def one(request: SimRequest) -> dict:
        await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
        sent = time.monotonic()
        times = await token_clock(session, url, {
            "model": args.model, "prompt": prompt(rng, request.input_len),
            "max_tokens": request.output_len, "ignore_eos": True})
        if len(times) != request.output_len:
            raise RuntimeError(f"{len(times)} tokens streamed for {request.output_len} asked")
        return {"ttft_s": times[0] - sent,
                "tpot_s": (times[-1] - times[0]) / max(1, len(times) - 1)}

    return await asyncio.gather(*(one(r) for r in requests))


MODELS = ("current", "7dad880", "eb12b7d")


def simulate(name: str, model: LatencyModel, factors: Multiplexing | None,
             requests: list[SimRequest], noise: ServiceNoise | None,
             as_of: str = "current", share: PlannerShare | None = None,
             mixed_extra_s: float = 0.0) -> list[dict]:
    """chunk512: the chunked instance step by step (``ChunkedInstanceSim``). multiplex: one
    multiplexing instance (``GroupSim``; requests go straight to it, no gateway admission:
    a blind dispatch over one instance never refuses), by the cycle model, or with
    ``share`` by the planner model (``Multiplexing``). ``as_of="eb12b7d"``: the models as
    they were at the first H200 validation (a mixed step as decode step plus prefill piece;
    multiplexing's fixed factors, no cycle). The chunked instance of now plans each step as
    the engine's overlap scheduling does and adds ``mixed_extra_s`` to each mixed step
    (``fit_mixed_step_extra``)."""
    fresh = [SimRequest(r.arrival, r.input_len, r.output_len) for r in requests]
    old = as_of == "eb12b7d"
    if name == "chunk512":
        ChunkedInstanceSim(model, chunk_size=512, noise=noise,
                           mixed_step="sum" if old else "roofline",
                           mixed_step_extra_s=0.0 if old else mixed_extra_s,
                           overlap=not old).run(fresh)
    else:
        factors = Multiplexing(factors.decode_slowdown, factors.prefill_slowdown) if old \
            else dataclasses.replace(factors, share=share)
        GroupSim(model, 1, 0, dispatch="least-connections", max_wait_s=1e9,
                 multiplexing=factors, noise=noise).run(fresh)
    return latency_rows(fresh)


def latency_rows(requests: list[SimRequest]) -> list[dict]:
    """Each simulated request's TTFT and TPOT (per request, (last - first token) over the
    tokens after the first), as the measured ones are."""
    return [{"ttft_s": r.first_token - r.arrival,
             "tpot_s": (r.finished - r.first_token) / max(1, r.output_len - 1)}
            for r in requests]


def planner_share(schedule_args: str, interference: dict, model: LatencyModel,
                  args, as_of: str = "current", only: str | None = None) -> PlannerShare | None:
    """The planner model (``PlannerShare``) of a multiplexing schedule: the predictor it
    serves with (``--mux-predictor``) walked with its flags, the graph-step and floor sizes
    its engine planned with (``engine_planner``; a run that did not record them: off, as
    before those defaults) and what its engine learned
    over the probes (``engine_calibration``; a run that did not record it: the corrections
    the LooGLE fit's walks used), which choose each option; each option's pieces timed as
    the probes measured them (``probe_piece_timing``), and how much of the plan the
    instance delivered, fitted by replaying its own probe on the instance model
    (``fit_probe_delivered``). ``as_of="7dad880"``: the model as it was there, its pieces
    timed by the engine's corrections, a per-batch cost fitted on the LooGLE timelines
    (``SHARE_FIT``) and the delivered factor in closed form (``probe_delivered``). ``only``
    (a what-if): the planner walked with that one option (``ONE_OPTION``) and delivering
    what it delivered in the probes (``option_delivered``). None where the schedule plans
    with the roofline model: no fitted predictor to walk."""
    path = mux_predictor(schedule_args)
    if path is None:
        return None
    fit = json.loads(SHARE_FIT.read_text())
    planner = interference.get("engine_planner") or {}
    ran = ran_explicitly(schedule_args, engine_reported(interference))  # as it ran them
    settings = settings_of(ran, planner).learned(
        interference.get("engine_calibration") or fit["corrections"])
    predictor = served_predictor(ROOT / path)
    if as_of == "7dad880":
        share = PlannerShare(**share_table(predictor, settings), per_batch_s=fit["per_batch_s"])
        delivered = probe_delivered(share, interference, model, args)[0]
        if delivered <= 0:
            raise SystemExit(f"the probe's prompts took less than the fitted per-batch cost "
                             f"({fit['per_batch_s']:.3f} s a batch): no planner model")
        return dataclasses.replace(share, delivered=delivered)
    settings = dataclasses.replace(settings, piece_timing=probe_piece_timing(interference) or None)
    if only is not None:
        share = PlannerShare(**share_table(predictor, dataclasses.replace(settings,
                                                                          sharing=(only,))))
        return dataclasses.replace(share, delivered=option_delivered(interference, only))
    share = PlannerShare(**share_table(predictor, settings))
    return dataclasses.replace(share, delivered=fit_probe_delivered(share, interference,
                                                                    model, args))


def mux_predictor(schedule_args: str) -> str | None:
    """The fitted profile a multiplexing schedule plans with (None: the roofline model,
    no fitted predictor)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--mux-predictor")
    path = flags.parse_known_args(shlex.split(schedule_args))[0].mux_predictor
    return None if path in (None, "roofline") else path


def engine_planner_args(schedule_args: str, interference: dict) -> str:
    """The schedule's flags with the graph-step and floor sizes its engine planned with
    (``engine_planner``; a run that did not record them: off, as before those defaults),
    its sharing options and prefill rule as it ran them (``ran_explicitly``)."""
    planner = interference.get("engine_planner") or {}
    return ran_explicitly(
        schedule_args + f" --mux-graph-step-tokens {planner.get('graph_step_tokens', 0)}"
        + f" --mux-mixed-floor-tokens {planner.get('mixed_floor_tokens', 0)}",
        engine_reported(interference))


def engine_reported(interference: dict) -> dict:
    """What the run's multiplex engine reported of its planner and calibration, in the
    shape ``ran_explicitly`` reads (the engine's ``describe()``)."""
    return {**(interference.get("engine_planner") or {}),
            "calibration": interference.get("engine_calibration") or {}}


PROBE_TIMING_DRAWS = 5


def simulated_steps(schedule_args: str, interference: dict, requests: list[SimRequest],
                    probe_timeline: list[dict] | None = None) -> list[dict] | None:
    """The step model's rows (``mux_steps.engine_timed``), None where the schedule plans
    with the roofline model. Without ``probe_timeline`` no spread is drawn: each mixed-step
    path at the one correction its engine learned on the probes. With it (the engine's
    decisions over the probes) the steps are timed by the probes' own
    (``mux_steps.step_spread``: graph steps by decode batch over the profile),
    ``PROBE_TIMING_DRAWS`` draws pooled: the correction after the probes is where an
    average over their last steps ended, and at 6b7fcf7 its 2.4% over the replay's graph
    steps was the whole TTFT miss."""
    path = mux_predictor(schedule_args)
    if path is None:
        return None
    predictor = served_predictor(ROOT / path)
    server_args = engine_planner_args(schedule_args, interference)
    spread, draws = None, 1
    if probe_timeline:
        graph_tokens = (interference.get("engine_planner") or {}).get("graph_step_tokens") or 0
        spread = step_spread(probe_timeline, "probes", predictor, graph_tokens)
        draws = PROBE_TIMING_DRAWS
    rows = []
    for seed in range(draws):
        fresh = [StepRequest(r.arrival, r.input_len, r.output_len) for r in requests]
        engine_timed(predictor, server_args, interference.get("engine_calibration"), fresh,
                     spread, seed)
        rows += latency_rows(fresh)
    return rows


def with_step_model(simulated: dict, schedule_args: str, interference: dict,
                    requests: list[SimRequest], probe_timeline: list[dict] | None = None
                    ) -> dict:
    """``simulated`` with the step model's rows where it runs (``simulated_steps``), and
    with the probes' step timing beside them where their timeline was kept."""
    rows = simulated_steps(schedule_args, interference, requests)
    if rows is None:
        return simulated
    simulated = {**simulated, "simulated_steps": rows}
    if probe_timeline:
        simulated["simulated_steps_probe_timing"] = simulated_steps(
            schedule_args, interference, requests, probe_timeline)
    return simulated


def steps_cover(interference: dict) -> dict:
    """Whether the engine ran only what the step model has (whole-GPU steps) in the
    replay, by its timeline's seconds per mode (None: not recorded)."""
    seconds = (interference.get("timeline_replay") or {}).get("seconds_by_mode")
    whole_gpu = None if seconds is None else all(
        mode in ("temporal", "decode_only", "prefill_only") for mode, s in seconds.items()
        if s > 0)
    return {"engine_ran_whole_gpu_steps_only": whole_gpu}


ONE_OPTION = ("temporal", "time_slice")


def option_delivered(interference: dict, option: str) -> float:
    """Planned over realized prefill rate of ``option`` over the probes (the engine's
    timeline: ``prefill_delivery``'s realized over committed rate, inverted); stops with
    the reason where the probes did not run it."""
    delivery = (interference.get("timeline_probes") or {}).get("prefill_delivery", {})
    if option not in delivery:
        raise SystemExit(f"the probes ran no {option} (ran: {', '.join(delivery) or 'none'}):"
                         f" nothing to say what it delivers")
    return 1.0 / delivery[option]["realized_over_committed"]


def probe_piece_timing(interference: dict) -> dict[str, float]:
    """Each option's prefill pieces' measured over predicted time (the median) over the
    probes, from the engine's timeline (``timeline_probes``); empty where the run did not
    record it (the walk then times pieces by the engine's corrections, as before)."""
    pieces = (interference.get("timeline_probes") or {}).get("piece_times", {})
    return {option: row["measured_over_predicted_p50"] for option, row in pieces.items()}


def fit_probe_delivered(share: PlannerShare, interference: dict, model: LatencyModel,
                        args) -> float:
    """Measured over planned prefill time: the factor with which the probe closest to the
    replay's state (the queue probe where the run has one, else the lone prompt), replayed
    on the multiplexing instance model (``simulated_mux_probe_s``), takes as long as it
    did. The replay keeps what the closed form (``probe_delivered``) left out: the decode
    streams' own prompts still prefilling when the probe's arrive (at 7dad880 the queue
    probe's eight 4K prompts took longer than the warm-up, and the closed form put their
    time on the probe's four: 2.40 of the plan)."""
    probe, steps = _closest_probe(interference, args)

    def probe_s(delivered: float) -> float:
        return simulated_mux_probe_s(model, dataclasses.replace(share, delivered=delivered),
                                     args, probe, steps)

    delivered = solve_rising(probe_s, probe["prompt_s"], 0.05, 20.0)
    # Not rising everywhere: a prompt that starts after the decode streams ended runs alone.
    if abs(probe_s(delivered) / probe["prompt_s"] - 1.0) > 0.01:
        raise SystemExit(f"no delivered factor replays the probe's {probe['prompt_s']:.3f} s "
                         f"(at {delivered:.3f}: {probe_s(delivered):.3f} s)")
    return delivered


def _closest_probe(interference: dict, args) -> tuple[dict, int]:
    """The queue probe where recorded (else the lone one) and its streams' decode steps."""
    if "queue" in interference:
        return interference["queue"], args.mix_steps * (1 + args.mix_queue // 2)
    return {"prompts": 1, **interference}, args.mix_steps


def simulated_mux_probe_s(model: LatencyModel, share: PlannerShare, args, probe: dict,
                          decode_steps: int) -> float:
    """The probe (``_probe``) replayed on one multiplexing instance with the planner model:
    ``--mix-batch`` requests of the probe's decode context at 0, decoding ``decode_steps``
    tokens, its prompts at ``--mix-warmup-s``; the time from then until the last prompt's
    first token, as ``prompt_s`` measures it."""
    decodes = [SimRequest(0.0, probe.get("decode_context", args.decode_contexts[0]),
                          decode_steps) for _ in range(args.mix_batch)]
    prompts = [SimRequest(args.mix_warmup_s, args.mix_prompt, 1)
               for _ in range(probe.get("prompts", 1))]
    GroupSim(model, 1, 0, dispatch="least-connections", max_wait_s=1e9,
             multiplexing=Multiplexing(1.0, 1.0, share=share)).run(decodes + prompts)
    return max(float(r.first_token or 0.0) for r in prompts) - args.mix_warmup_s


def solve_rising(f: Callable[[float], float], target: float, low: float,
                 high: float) -> float:
    """The x in [``low``, ``high``] where the non-decreasing ``f`` reaches ``target``
    (bisection in logarithms); stops with the reason where the range does not hold it."""
    if not f(low) <= target <= f(high):
        raise SystemExit(f"no factor from {low} to {high} gives {target:.3f} s")
    while high / low > 1 + 1e-6:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if f(middle) < target else (low, middle)
    return math.sqrt(low * high)


def probe_delivered(share: PlannerShare, interference: dict, model: LatencyModel,
                    args) -> tuple[float, str]:
    """The planner model's delivered factor as of 7dad880 (now ``fit_probe_delivered``).
    Measured over planned prefill time in the probe closest to the replay's state (the
    queue probe where the run has one, else the lone prompt), and which: its prompts' time,
    less the per-batch cost of the batches the planner splits them into, against each
    prompt alone (the fitted model) times the planner's factor beside the probe's decode
    batch (the batch's context as ``chunked_probe_prediction`` counts it: prompt plus the
    tokens of the warm-up)."""
    name = "queue" if "queue" in interference else "lone"
    probe = interference["queue"] if name == "queue" else interference
    prompts = probe.get("prompts", 1)
    context = args.mix_batch * (probe.get("decode_context", args.decode_contexts[0])
                                + round(args.mix_warmup_s / (probe["step_ms_before"] / 1e3)))
    load = (args.mix_batch, context, args.mix_prompt)
    batches_s = prompts * share.per_batch_s * share.planned_batches(*load)
    planned = prompts * model.prefill_s(args.mix_prompt) * share.planned_prefill(*load)
    return (probe["prompt_s"] - batches_s) / planned, name


def simulate_both(name: str, model: LatencyModel, factors: Multiplexing | None,
                  requests: list[SimRequest], noise: ServiceNoise | None,
                  share: PlannerShare | None, as_of: str = "current",
                  mixed_extra_s: float = 0.0) -> dict:
    """Each simulation of a schedule, named as the results keep them: with the measured
    spread where ``noise`` is given and medians only; for multiplexing with ``share``, the
    planner model's beside the cycle model's."""
    runs = {"simulated_medians_only": simulate(name, model, factors, requests, None, as_of,
                                               mixed_extra_s=mixed_extra_s)}
    if noise is not None:
        runs["simulated"] = simulate(name, model, factors, requests, noise, as_of,
                                     mixed_extra_s=mixed_extra_s)
    if share is not None and name == "multiplex" and as_of != "eb12b7d":
        runs["simulated_planner_medians_only"] = simulate(name, model, factors, requests,
                                                          None, share=share)
        if noise is not None:
            runs["simulated_planner"] = simulate(name, model, factors, requests, noise,
                                                 share=share)
    return runs


async def validate(args, name: str, schedule_args: str) -> dict:
    from aiohttp import ClientSession, ClientTimeout

    phases, clock = {}, time.monotonic()
    server = start_serve(args.model, *shlex.split(args.serve_args), *shlex.split(schedule_args))
    phases["start_s"] = time.monotonic() - clock
    rng = np.random.default_rng(args.seed)
    url = server.url + "/v1/completions"
    try:
        async with ClientSession(timeout=ClientTimeout(total=None)) as session:
            result = await _measure_and_replay(name, schedule_args, session, url, args, rng,
                                               phases)
    finally:
        server.stop()
        _keep_log(server, Path(args.out) / f"{name}_server.log")
    return {"schedule_args": schedule_args, "phases_s": phases, **result}


async def _measure_and_replay(name: str, schedule_args: str, session, url: str, args, rng,
                              phases: dict) -> dict:
    clock = time.monotonic()
    prefill_points, prefill_ratios = await measure_prefill(session, url, args, rng)
    decode_points, decode_ratios = await measure_decode(session, url, args, rng)
    model = LatencyModel.fit(prefill_points, decode_points, kv_bytes_per_token(args.model),
                             decode_kv_tokens=args.decode_kv_tokens)
    factors, mix = await _probes(name, session, url, args, rng, model)
    phases["calibrate_s"] = time.monotonic() - clock
    requests, workload = window_requests(args, model)
    clock, load_before = time.monotonic(), os.getloadavg()[0]
    measured = await replay(session, url, requests, args, rng)
    phases["replay_s"] = time.monotonic() - clock
    share = None
    if name == "chunk512":
        # The replay's steps against the model's step for each one's shape: which steps a
        # miss of the percentiles comes from (the steps kept beside the result).
        steps = await timeline_entries(session, url, clock,
                                       keep=Path(args.out) / f"{name}_steps_replay.json.gz")
        mix["replay_steps_check"] = step_check(model, mix.get("mixed_step_extra_s", 0.0),
                                               steps)
    if name == "multiplex":
        mix["timeline_replay"] = await engine_timeline(
            session, url, clock, keep=Path(args.out) / f"{name}_timeline_replay.json.gz")
        # What the engine learned by the replay's end: the planner's choice between mixed
        # steps and time slices follows its mixed-step correction, which the walk takes
        # from after the probes (``engine_calibration``).
        mix["engine_calibration_after_replay"] = (await engine_info(session, url)).get(
            "calibration")
        mix["cycle_covers_every_batch"] = cycle_covers(model, factors, requests)
        share = planner_share(schedule_args, mix, model, args)
        mix["planner_share"] = _share_summary(share, mix, model, args, requests)
    noise = ServiceNoise(prefill_ratios, decode_ratios, seed=args.seed)
    simulated = simulate_both(name, model, factors, requests, noise, share,
                              mixed_extra_s=mix.get("mixed_step_extra_s", 0.0))
    if name == "multiplex":
        simulated = with_step_model(simulated, schedule_args, mix, requests,
                                    load_timeline(_probe_timeline_path(args, name)))
        mix["step_model"] = steps_cover(mix)
    return {"service_points": {"prefill": prefill_points, "decode": decode_points},
            "service_spread": {"prefill": spread(prefill_ratios),
                               "decode_step": spread(decode_ratios)},
            # The draws' source, so that an offline re-simulation can draw them again.
            "service_ratios": {"prefill": prefill_ratios, "decode_step": decode_ratios},
            "latency_model": dataclasses.asdict(model),
            "interference": {**(dataclasses.asdict(factors) if factors else {}), **mix},
            "workload": workload,
            "host_load_average_1min": {"replay_start": load_before,
                                       "replay_end": os.getloadavg()[0]},
            "measured_per_request": measured,
            "compare": compare(measured, simulated)}


async def _probes(name: str, session, url: str, args, rng,
                  model: LatencyModel) -> tuple[Multiplexing, dict]:
    """The interference probes; for chunked prefill with what the model predicts of them,
    for multiplexing with the engine's timeline over them (modes, cycles, prefill rates)."""
    since = time.monotonic()
    factors, mix = await measure_interference(session, url, args, rng, model)
    if name == "chunk512":
        mix.update(chunked_probe_prediction(model, args, mix))
        if "queue" in mix:
            mix["queue"].update(chunked_probe_prediction(model, args, mix["queue"]))
        mix["mixed_step_extra_s"], checks = fit_mixed_step_extra(model, args, mix)
        mix.update(checks)
    else:
        # Kept whole too: what the planner's corrections learned on the probes, step by step,
        # to set beside the replay's steps (at 6b7fcf7 the probes taught graph steps 1.053
        # where the replay's ran 1.03, and that 2.4% was the whole TTFT miss).
        mix["timeline_probes"] = await engine_timeline(
            session, url, since, keep=_probe_timeline_path(args, name))
        # What the planner learned over the probes and the sizes it plans with (graph
        # steps resolved from ``auto``): the planner model walks with both.
        info = await engine_info(session, url)
        mix["engine_calibration"] = info.get("calibration")
        mix["engine_planner"] = {key: info.get(key)
                                 for key in ("graph_step_tokens", "mixed_floor_tokens",
                                             "sharing")}
    return factors, mix


def _probe_timeline_path(args, name: str) -> Path:
    return Path(args.out) / f"{name}_timeline_probes.json.gz"


async def engine_timeline(session, url: str, since: float, keep: Path | None = None) -> dict:
    """The multiplexing engine's planning decisions since ``since`` (this host's
    ``time.monotonic()``), summarised as the LooGLE runs are (``summarise_timeline``);
    with ``keep``, the decisions themselves written there (gzipped JSON): each one's
    option, decode batch and cycle, to set beside what the planner model walks."""
    entries = await timeline_entries(session, url, since, keep)
    itl_ms = (await engine_info(session, url)).get("itl_slo_ms") or 60.0
    return summarise_timeline(entries, since, itl_ms)


async def timeline_entries(session, url: str, since: float, keep: Path | None = None
                           ) -> list[dict]:
    """The engine's timeline since ``since``: a multiplexing engine's decisions, a chunked
    one's steps; with ``keep``, also written there (gzipped JSON)."""
    entries = await engine_timeline_since(session, url.rsplit("/v1/", 1)[0], since)
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(keep, "wt") as f:
            json.dump(entries, f)
    return entries


async def engine_info(session, url: str) -> dict:
    async with session.get(url.rsplit("/v1/", 1)[0] + "/v1/engine/info") as resp:
        return await resp.json()


def resimulate(path: str, as_of: str = "current", extra_from: str | None = None,
               only: str | None = None, grid: str | None = None) -> dict:
    """Re-runs the simulations of a recorded validation with the models of now (or as of
    ``as_of``), from its own calibration: the same requests (``window_requests`` with the
    run's arguments and fitted model), its interference probe, and its measured spread
    where the file recorded the ratios (``service_ratios``); the medians-only simulation
    needs none. ``extra_from``: the chunked mixed step's extra cost fitted on that recorded
    run's lone probe instead (a run without its own probe). ``only``: the planner model
    walked with that one option (``planner_share``). ``grid``: the chunked mixed step's
    grid terms fitted on that measured grid (``fit_mixed_step_grid``) on top of the run's
    model, its extra cost refitted with them. No GPU, no server."""
    recorded = json.load(open(path))
    args = recorded_args(recorded)
    table, covered, extra = {}, {}, {}
    for name, run in recorded["schedules"].items():
        model = LatencyModel(**run["latency_model"])
        requests, workload = window_requests(args, model)
        if workload["requests"] != run["workload"]["requests"]:
            raise SystemExit(f"{name}: {workload['requests']} requests rebuilt, "
                             f"{run['workload']['requests']} recorded")
        factors, share = _recorded_factors(run["interference"]), None
        if name == "multiplex":
            covered[name] = cycle_covers(model, factors, requests)
            if as_of != "eb12b7d":
                share = planner_share(run["schedule_args"], run["interference"], model, args,
                                      as_of, only)
                covered["multiplex_planner"] = _share_summary(share, run["interference"], model,
                                                              args, requests, as_of)
        ratios = run.get("service_ratios")
        noise = ServiceNoise(ratios["prefill"], ratios["decode_step"], seed=args.seed) \
            if ratios else None
        extra_s = 0.0
        if name == "chunk512":
            model = with_grid_terms(model, grid)
            extra_s, extra["from"] = recorded_mixed_step_extra(extra_from or path, grid)
            extra.update(mixed_step_extra_s=extra_s, mixed_step_grid=grid and _relative(grid))
        simulated = simulate_both(name, model, factors, requests, noise, share, as_of, extra_s)
        if name == "multiplex" and as_of == "current" and only is None:
            simulated = with_step_model(simulated, run["schedule_args"], run["interference"],
                                        requests, committed_probe_timeline(path))
            covered["multiplex_steps"] = steps_cover(run["interference"])
        measured = {key: row["measured"] for key, row in run["compare"].items()}
        table[name] = compare_percentiles(measured, simulated)
    return {"resimulated_from": os.path.relpath(path, ROOT), "models_as_of": as_of,
            "planner_options": only or "all",
            "schedules": table, "cycle_covers_every_batch": covered, "chunked": extra}


def recorded_args(recorded: dict) -> argparse.Namespace:
    """A recorded validation's arguments, its trace resolved from the repository root."""
    args = argparse.Namespace(**recorded["config"])
    args.trace = str(ROOT / args.trace)
    return args


def recorded_multiplexing(path: str) -> Multiplexing | None:
    """The planner model of a recorded validation's multiplexing instance, as
    ``resimulate`` builds it (``planner_share`` from the run's own calibration), on the
    run's measured cycle model for loads past the walked grid; None where the run has no
    planner model (a roofline schedule) or no interference probe."""
    recorded = json.load(open(path))
    run = recorded["schedules"]["multiplex"]
    share = planner_share(run["schedule_args"], run["interference"],
                          LatencyModel(**run["latency_model"]), recorded_args(recorded))
    factors = _recorded_factors(run["interference"])
    return None if share is None or factors is None else dataclasses.replace(factors,
                                                                             share=share)


def committed_probe_timeline(path: str) -> list[dict] | None:
    """The engine's decisions over a recorded validation's probes, where they were
    committed beside it (``<stem>_multiplex_timeline_probes.json.gz``); None where not."""
    probes = Path(path).with_name(Path(path).stem + "_multiplex_timeline_probes.json.gz")
    return load_timeline(probes) if probes.exists() else None


def with_grid_terms(model: LatencyModel, grid: str | None) -> LatencyModel:
    """The model with the mixed step's grid terms fitted on ``grid`` (none: as it is)."""
    return model if grid is None else fit_mixed_step_grid(model, json.load(open(grid)))


def recorded_mixed_step_extra(path: str, grid: str | None = None) -> tuple[float, str]:
    """The chunked mixed step's extra cost (``fit_mixed_step_extra``) fitted on a recorded
    run's probes (``fit_mixed_step_extra``: the queue probe where it has one), and where
    from; with ``grid``, on top of the grid terms fitted there."""
    recorded = json.load(open(path))
    args = argparse.Namespace(**recorded["config"])
    run = recorded["schedules"]["chunk512"]
    model = with_grid_terms(LatencyModel(**run["latency_model"]), grid)
    extra_s, checks = fit_mixed_step_extra(model, args, run["interference"])
    source = os.path.relpath(path, ROOT)
    return extra_s, (f"{source}'s {checks['fitted_on']}" if checks
                     else f"none: {source} has no probe of mixed steps")


def cycle_covers(model: LatencyModel, factors: Multiplexing, requests: list[SimRequest]) -> bool:
    """Whether multiplexing's cycle model holds for every batch the replay can form: a
    bound, every request decoding at once at its full length, stays within the cycle (else
    some batches take the fixed factors, ``Multiplexing``)."""
    context = sum(r.input_len + r.output_len for r in requests)
    return factors.covers(model.decode_step_s(len(requests), context))


def _share_summary(share: PlannerShare | None, interference: dict, model: LatencyModel,
                   args, requests: list[SimRequest], as_of: str = "current") -> dict:
    """What the planner model ran with, and whether the replay stays inside its grid (the
    bound of ``cycle_covers``: every request decoding at once at its full length)."""
    if share is None:
        return {"model": None, "why": "the schedule plans with the roofline model"}
    context = sum(r.input_len + r.output_len for r in requests)
    fit = json.loads(SHARE_FIT.read_text())
    source = "queue" if "queue" in interference else "lone"
    summary = {"model": "planner", "delivered_over_planned": share.delivered,
               "delivered_from": f"{source} probe", "per_batch_s": share.per_batch_s,
               "engine_calibration_recorded": bool(interference.get("engine_calibration")),
               "covers_every_batch": share.covers(len(requests), context)}
    if as_of == "7dad880":
        return {**summary, "delivered_over_planned_loogle_fit": fit["delivered_over_planned"]}
    return {**summary, "delivered_fit": "the probe replayed on the instance model",
            "piece_timing": probe_piece_timing(interference)}


def _recorded_factors(interference: dict) -> Multiplexing | None:
    if "decode_slowdown" not in interference:
        return None
    cycle = interference.get("cycle_s") or interference["step_ms_during"] / 1e3
    return Multiplexing(interference["decode_slowdown"], interference["prefill_slowdown"],
                        cycle_s=cycle)


def _keep_log(server: ServeProcess, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    server.log.seek(0)
    path.write_bytes(server.log.read())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="Directory for the JSON and logs (with --resimulate: "
                        "the JSON file to write the re-simulation to, if any).")
    parser.add_argument("--resimulate", metavar="FILE.json",
                        help="No GPU, no server: re-simulate a recorded validation with the "
                        "models of now and print measured vs simulated.")
    parser.add_argument("--models-as-of", choices=MODELS, default="current",
                        help="With --resimulate: eb12b7d runs the models as they were at the "
                        "first H200 validation, 7dad880 the multiplexing planner model as it "
                        "was there.")
    parser.add_argument("--mixed-step-extra-from", metavar="FILE.json",
                        help="With --resimulate: the chunked mixed step's extra cost fitted "
                        "on this recorded run's probes (for a run that has none).")
    parser.add_argument("--mixed-step-grid", metavar="GRID.json",
                        help="With --resimulate: the chunked mixed step's grid terms fitted "
                        "on this bench_mixed_step.py --grid result (default: the roofline "
                        "form the run was fitted with).")
    parser.add_argument("--planner-only", choices=ONE_OPTION,
                        help="With --resimulate (a what-if): the planner model walked with this "
                        "one option, delivering what it delivered in the run's probes.")
    parser.add_argument("--smoke", action="store_true",
                        help="The tiny model on CPU, small lengths, 20 s replays (flags given "
                        "beside it win over its values).")
    parser.add_argument("--schedules", default="chunk512,multiplex",
                        help=f"Of {', '.join(SCHEDULES)}.")
    parser.add_argument("--model", default="codellama-34b")
    parser.add_argument("--serve-args", default="--device cuda --dtype bfloat16 "
                        "--max-model-len 16384")
    parser.add_argument("--prompt-lens", type=ints, default=[1024, 4096, 8192])
    parser.add_argument("--decode-batches", type=ints, default=[1, 8, 32])
    # Two contexts: with one, the per-KV-token cost cannot be told from the per-request one.
    parser.add_argument("--decode-contexts", type=ints, default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=64,
                        help="Tokens per calibration stream (the first and last 8 untimed).")
    parser.add_argument("--trace", default=str(WINDOW_TRACE))
    parser.add_argument("--window-start-s", type=float, default=0.0)
    parser.add_argument("--window-s", type=float, default=600.0)
    parser.add_argument("--input-scale", type=float, default=0.5)
    parser.add_argument("--output-scale", type=float, default=0.5)
    parser.add_argument("--max-input", type=int, default=8192)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--replay-s", type=float, default=60.0)
    parser.add_argument("--load", type=float, default=0.6,
                        help="Fitted prefill utilisation of the replay.")
    parser.add_argument("--mix-prompt", type=int, default=8192)
    parser.add_argument("--mix-batch", type=int, default=8)
    parser.add_argument("--mix-steps", type=int, default=300)
    parser.add_argument("--mix-queue", type=int, default=4,
                        help="Prompts at once in the queue probe (1: none).")
    parser.add_argument("--mix-warmup-s", type=float, default=3.0)
    parser.add_argument("--decode-kv-tokens", type=int, default=290_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expect-gpu", help="stop before any server unless the GPU's name "
                        "contains this (default: H200 for codellama-34b, else any; 'any': "
                        "no check)")
    if parser.parse_known_args()[0].smoke:
        # As defaults, not over the parsed values: a flag given beside --smoke is taken,
        # where an update after parsing dropped it without a word.
        parser.set_defaults(**SMOKE)
    args = parser.parse_args()
    if not (args.out or args.resimulate):
        parser.error("--out is required (or --resimulate FILE.json)")
    if args.planner_only and not (args.resimulate and args.models_as_of == "current"):
        parser.error("--planner-only is a what-if of the models of now: with --resimulate")
    return args


def main() -> int:
    args = parse_args()
    if args.resimulate:
        result = resimulate(args.resimulate, args.models_as_of, args.mixed_step_extra_from,
                            args.planner_only, args.mixed_step_grid)
        if args.out:
            config = {k: _relative(v) for k, v in vars(args).items() if k != "out"}
            write_json({**result_header(config), "kind": "validation", **result}, args.out)
        return print_resimulation(result)
    table = SMOKE_SCHEDULES if args.smoke else SCHEDULES
    unknown = [s for s in args.schedules.split(",") if s not in table]
    if unknown:
        raise SystemExit(f"unknown schedule {unknown}: choose from {', '.join(table)}")
    check_gpu(expected_gpu(args.expect_gpu, args.model))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # on CPU: the instance, not every core
    config = {k: v for k, v in vars(args).items() if k != "out"}
    header = result_header({**config, "trace": os.path.relpath(args.trace, ROOT)})
    report = {**header, "kind": "validation", "schedules": {}}
    for name in args.schedules.split(","):
        report["schedules"][name] = asyncio.run(validate(args, name, table[name]))
        write_json(report, Path(args.out) / "sim_validate_instance.json")
        for key, row in report["schedules"][name]["compare"].items():
            print(name, key, json.dumps(row), flush=True)
    return 0


def _relative(value):
    """A path under the repository as the repository names it (results carry no host's
    checkout path); any other value unchanged."""
    if isinstance(value, str) and value.startswith(str(ROOT) + os.sep):
        return os.path.relpath(value, ROOT)
    return value


def print_resimulation(result: dict) -> int:
    print(f"re-simulated offline from {result['resimulated_from']} (models as of "
          f"{result['models_as_of']}); measured figures are the recorded run's; "
          f"multiplexing's cycle covers every batch: {result['cycle_covers_every_batch']}; "
          f"chunked: {result['chunked']}")
    for name, table in result["schedules"].items():
        for key, row in table.items():
            print(name, key, json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
