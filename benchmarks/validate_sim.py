"""Validation: a real P/D group (one prefill and one decode instance behind the real gateway)
against the simulator fitted to those instances.

1. Warm the group (``--warmup-s`` of untimed prompts through the gateway, and one
   untimed round of decode streams: a fresh group's first seconds ran 2x slow), then
   measure the instances' service times over HTTP, on the replay's path (through the
   gateway): prefill as the TTFT of streamed answers of several prompt lengths (one at a
   time; one-token completions straight at the prefill instance kept beside), decode as
   the interval between streamed tokens of ``batch`` requests running together at two
   prompt lengths, and the handoff: how long after its first token a request, alone,
   joins the decode batch (its second token's gap less one decode step of its own); and how the
   two instances slow each other where they share the host's cores (``measure_sharing``:
   decode steps with and without prompts running on the prefill instance, prompts with
   and without a decode running; ``measure_prefill_on_path``: prompts through the
   gateway beside a decode, as the replay's), and how much longer a prompt takes after
   the group idled (``measure_idle_wake``). Each instance runs on a core of its own
   (``--pin-cores``).
2. Fit ``LatencyModel.fit`` to those points, ``fit_handoff`` to the handoff's,
   ``fit_gateway_hop`` to prompts through the gateway against straight at the instance
   (the gateway's hops, a delay that occupies no instance),
   ``SharedCores.from_probe`` to the probe's (on GPUs of their own: factors near 1) and
   ``IdleWake`` to the idle probe's.
3. Replay one request list (Poisson arrivals, random prompt and answer lengths, answers
   of exactly their length) through the gateway, streamed, and through ``GroupSim`` with
   the fitted model; report measured and simulated TTFT and TPOT percentiles side by side,
   and where the measured TPOTs go (``decode_timing``).

After the replay the prompts (both ways) and ``--decode-rounds-after`` rounds of decode
steps are timed again (``recalibrate``): how far the host drifted over the run, and the
model of step 2 fitted to both sides' points pooled (``bracketed``), simulated beside as
``simulated_calibrated_both_sides``. The figures stay the model fitted before the replay:
over five runs (156c086-bcc1c68) the pooled one was no closer (within 10% on all four
percentiles in three against four; the host that changed speed around one replay kept
its pace after another).

On CPU (the default: the tiny model) the instances, the gateway and the client share the
host's cores; keep ``--rate`` low enough that requests rarely overlap (the report records
how busy the prefill side was). On a host of three or more cores ``--client-core rest``
keeps the gateway and the client off both instances' cores. On GPUs, e.g.::

    python benchmarks/validate_sim.py --model codellama-34b \\
        --serve-args "--device cuda --dtype bfloat16" --prompt-lens 1024,4096,8192,16384 \\
        --decode-batches 1,16,64 --decode-contexts 1024,8192 --rate 0.5 --requests 300 \\
        --step-floor-ms 15 --out benchmarks/results/validation_h200_codellama34b.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sim_pd_dispatch import kv_bytes_per_token  # noqa: E402
from pdserve.bench.report import load_json, result_header, write_json  # noqa: E402
from pdserve.sim.cluster import (  # noqa: E402
    GroupSim,
    IdleWake,
    LatencyModel,
    PrefillSteps,
    ServiceNoise,
    SharedCores,
    SimRequest,
    fit_nonnegative,
)
from pdserve.testing import ServeProcess, free_port, start_serve  # noqa: E402

VOCAB = 250  # token ids below the tiny model's special tokens
STEP_WINDOW = 8
# glibc hands a freed block above its mmap threshold (128 KiB to start with) back to the
# OS and trims the heap's top, so a CPU instance's per-step temporaries (a 1K-token
# context's gathered K/V among them) can be mapped and faulted in afresh every step. Five
# runs at 02a2a27-f8b41cb timed their calibration's ~1.1K-context decode points at 1.5-2.7x
# the same points after the replay, the instances fresh; with the heap kept (these two
# settings, ``--keep-heap``) three runs timed them at 0.8-1.3x.
KEEP_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's largest
                 "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def start_instance(args, cores: set[int] | None) -> ServeProcess:
    """One instance; with ``cores``, its processes run on those cores only (a child
    inherits the affinity of the thread that started it; this thread's is put back)."""
    if cores is None:
        return start_serve(args.model, "--kv-transfer-port", "0", *shlex.split(args.serve_args))
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        return start_instance(args, None)
    finally:
        os.sched_setaffinity(0, previous)


def physical_core(cpu: int) -> str:
    """The hardware threads of ``cpu``'s core (itself and its SMT siblings), as the kernel
    lists them; ``cpu`` alone where the kernel does not say."""
    siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return siblings.read_text().strip()
    except OSError:
        return str(cpu)


def instance_cores(args) -> list[set[int] | None]:
    """The prefill's and the decode instance's cores: one each, the first two of this
    process's cores on different physical cores where there are two (SMT siblings share a
    core's units; ``--pin-cores``; the gateway and the client where ``--client-core``
    says), or none pinned."""
    if not args.pin_cores:
        return [None, None]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"--pin-cores needs two cores, this process may use {cores}; "
                         "run with --no-pin-cores")
    first_of_each = {}
    for cpu in cores:
        first_of_each.setdefault(physical_core(cpu), cpu)
    chosen = sorted(first_of_each.values()) if len(first_of_each) > 1 else cores
    return [{chosen[0]}, {chosen[1]}]


def client_cores(args) -> set[int] | None:
    """The gateway's and the client's cores (``--client-core``): the prefill instance's,
    every core but the two instances' and their SMT siblings (``rest``; a host of three or
    more cores, where nothing else shares an instance's core), or none pinned (``any``)."""
    if not args.pin_cores or args.client_core == "any":
        return None
    instances = instance_cores(args)
    if args.client_core == "prefill":
        return instances[0]
    taken = {physical_core(min(cpu)) for cpu in instances}
    rest = {cpu for cpu in os.sched_getaffinity(0) if physical_core(cpu) not in taken}
    if not rest:
        raise SystemExit("--client-core rest needs a core beside the instances' two, this "
                         f"process may use {sorted(os.sched_getaffinity(0))}")
    return rest


class HostMeters:
    """``host_meter.py`` beside each instance, on its core (``--host-meter-period-s``): how
    fast the host ran through calibration, replay and recalibration, apart from the
    instances."""

    def __init__(self, args) -> None:
        self.period_s = args.host_meter_period_s
        self.processes: dict[str, subprocess.Popen] = {}
        if self.period_s <= 0:
            return
        self.folder = tempfile.TemporaryDirectory()
        for role, cores in zip(("prefill", "decode"), instance_cores(args), strict=True):
            core = ["--core", str(min(cores))] if cores else []
            self.processes[role] = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("host_meter.py")), *core,
                 "--period-s", str(self.period_s), "--out", self._path(role)])

    def _path(self, role: str) -> str:
        return os.path.join(self.folder.name, f"{role}.jsonl")

    def stop(self, replay_start: float, marks: dict[str, float]) -> dict | None:
        """The samples (s from the replay's start, ms) and, per phase between ``marks``
        (``time.monotonic()`` at each phase's start), the medians over calibration's."""
        for process in self.processes.values():
            process.terminate()
            process.wait(timeout=30)
        if not self.processes:
            return None
        samples, cache = {}, {}
        for role in self.processes:
            with open(self._path(role)) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            samples[role] = [[round(r[0] - replay_start, 3), round(r[1], 3)] for r in rows]
            cache[role] = [[round(r[0] - replay_start, 3), round(r[2], 3)]
                           for r in rows if len(r) > 2]
        self.folder.cleanup()
        return {"period_s": self.period_s, "samples": samples,
                "over_calibration": meter_phases(samples, replay_start, marks),
                # the read of a buffer the size of the model's working set: the shared
                # cache and memory, which the core work above does not reach
                "cache_samples": cache,
                "cache_over_calibration": meter_phases(cache, replay_start, marks)}


def meter_phases(samples: dict[str, list], replay_start: float, marks: dict[str, float]
                 ) -> dict:
    """Per core and phase (from its mark to the next one's), the meter's p50 / p90 / p99
    over its median through calibration."""
    if "calibration" not in marks:
        return {}  # stopped before calibrating: nothing to compare with
    bounds = sorted((t - replay_start, name) for name, t in marks.items())
    spans = {name: (start, end) for (start, name), (end, _) in
             zip(bounds, [*bounds[1:], (np.inf, "")], strict=True)}
    phases = {}
    for role, rows in samples.items():
        by_phase = {name: np.array([ms for t, ms in rows if start <= t < end])
                    for name, (start, end) in spans.items()}
        base = np.median(by_phase["calibration"]) if by_phase["calibration"].size else np.nan
        phases[role] = {name: {f"p{q}": float(np.percentile(ms, q) / base)
                               for q in (50, 90, 99)}
                        for name, ms in by_phase.items() if ms.size}
    return phases


def start_instances(args, cores: list[set[int] | None] | None = None) -> list[ServeProcess]:
    """One instance per entry of ``cores`` (default: the prefill and the decode instance's,
    ``instance_cores``), started side by side: a start is mostly one process loading torch
    and the model, which the cores do at once. Stops those that came up when one fails."""
    cores = instance_cores(args) if cores is None else cores
    with ThreadPoolExecutor(len(cores)) as pool:
        futures = [pool.submit(start_instance, args, instance) for instance in cores]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                future.result().stop()
        raise failed[0]
    return [f.result() for f in futures]


def prompt(rng: np.random.Generator, tokens: int) -> list[int]:
    return rng.integers(0, VOCAB, tokens).tolist()


async def token_clock(session, url: str, body: dict,
                      on_first: Callable[[], None] | None = None) -> list[float]:
    """``time.monotonic()`` at the arrival of every generated token. A chunk may carry
    several tokens (a model's random ids held back as incomplete UTF-8 until they decode),
    so tokens are counted by the chunk's ``logprobs`` and each takes its chunk's time.
    ``on_first`` is called as the first token arrives."""
    times: list[float] = []
    async with session.post(url, json={**body, "stream": True, "logprobs": 0}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                count = tokens_in_chunk(json.loads(line[len(b"data: "):]))
                if count and not times and on_first is not None:
                    on_first()
                times += [time.monotonic()] * count
    return times


def tokens_in_chunk(chunk: dict) -> int:
    choices = chunk.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") or {}
    return len(logprobs.get("tokens") or ())


async def measure_prefill(session, url: str, args, rng) -> tuple[list[dict], list[float]]:
    """Median latency per prompt length, and every sample over its length's median (the
    spread the simulator draws from)."""
    points, ratios = [], []
    for tokens in args.prompt_lens:
        seconds = []
        for _ in range(args.repeats):
            body = {"model": args.model, "prompt": prompt(rng, tokens), "max_tokens": 1}
            start = time.monotonic()
            async with session.post(url, json=body) as resp:
                await resp.read()
            seconds.append(time.monotonic() - start)
        median = float(np.median(seconds))
        points.append({"tokens": tokens, "seconds": median, "samples_s": seconds})
        ratios += [x / median for x in seconds]
    return points, ratios


async def measure_decode(session, url: str, args, rng) -> tuple[list[dict], list[float]]:
    """``measure_decode_streams`` straight at an instance, the ratios in one list."""
    points, streams = await measure_decode_streams(session, url, args, rng)
    return points, np.concatenate(streams).tolist()


async def measure_decode_streams(session, url: str, args, rng,
                                 prefill_s: Callable[[int], float] | None = None,
                                 ) -> tuple[list[dict], list[np.ndarray]]:
    """Median step per batch and context (each request's prompt and the tokens it had at
    the window's middle), and every timed step over its point's median, per stream in
    order. Only steps while the whole batch decodes count: the prompts of a batch prefill
    one after another (under chunked prefill a step then carries prompt pieces too), so
    the window starts at the batch's last first token and ends at its first last token;
    each request runs ``--decode-steps`` tokens past the longest such prefill phase - with
    ``prefill_s`` (prompts sent through the gateway prefill one after another on the
    prefill instance) that of the batch's prompts at the step of a batch of 1 at that
    context (a larger batch steps no faster; ``--step-floor-ms`` where none was timed
    before): a floor far below the steps ran the first requests on to contexts the replay
    never reaches (twice the prompt, where the tiny model's steps on CPU grew sevenfold). A step is
    timed over ``STEP_WINDOW`` tokens: a client that reads several chunks at once
    (descheduled a moment) would otherwise time single steps near zero beside one long one."""
    points: list[dict] = []
    ratio_streams: list[np.ndarray] = []
    for context in args.decode_contexts:
        floor_s: float | None = None  # the step of a batch of 1 at this context, once timed
        for batch in sorted(args.decode_batches):
            bound = prefill_steps_bound(batch, context)
            if prefill_s is not None and batch > 1:
                floor = floor_s if floor_s is not None else args.step_floor_ms / 1e3
                bound += int(batch * prefill_s(context) / floor) + 1
            body = {"model": args.model, "ignore_eos": True,
                    "max_tokens": args.decode_steps + bound}
            runs = await asyncio.gather(*(token_clock(session, url, {
                **body, "prompt": prompt(rng, context)}) for _ in range(batch)))
            streams = steady_windows(runs, batch, context, args.decode_steps)
            median = float(np.median(np.concatenate(streams)))
            if batch == 1:
                floor_s = median
            points.append({"batch": batch, "context": context + tokens_at_middle(runs),
                           "step_ms": median * 1e3, "streams": len(streams)})
            ratio_streams += [w / median for w in streams]
    return points, ratio_streams


async def measure_decode_rounds(session, url: str, args, rng,
                                prefill_s: Callable[[int], float], rounds: int,
                                warmup: int = 0) -> tuple[list[dict], list[np.ndarray]]:
    """``measure_decode_streams`` ``rounds`` times in a row, after ``warmup`` rounds
    kept out of the fit and the spread (their steps recorded as ``warmup_step_ms``):
    each point's step the median of its rounds' (its context their mean), each stream's
    ratios over that median.
    One round times each point in one stretch of the host, and the host's slow stretches
    last seconds to a minute: a point met in one moved the fitted step by 10-20% from
    run to run (a batch of 1 at 1,089 tokens stepped in 5.65 ms in one calibration,
    4.0-5.1 in others)."""
    warm = [(await measure_decode_streams(session, url, args, rng, prefill_s))[0]
            for _ in range(warmup)]
    rounds = [await measure_decode_streams(session, url, args, rng, prefill_s)
              for _ in range(rounds)]
    points, streams = [], []
    for i, point in enumerate(rounds[0][0]):
        steps = [r[0][i]["step_ms"] for r in rounds]
        median = float(np.median(steps))
        points.append({**point, "context": round(float(np.mean([r[0][i]["context"]
                                                                 for r in rounds]))),
                       "step_ms": median, "round_step_ms": steps,
                       "warmup_step_ms": [w[i]["step_ms"] for w in warm],
                       "streams": sum(r[0][i]["streams"] for r in rounds)})
        for (round_points, round_streams), step in zip(rounds, steps, strict=True):
            first = sum(p["streams"] for p in round_points[:i])
            streams += [w * step / median for w in
                        round_streams[first:first + round_points[i]["streams"]]]
    return points, streams


def tokens_at_middle(runs: list[list[float]]) -> int:
    """The tokens each request of a batch had generated, on average, at the middle of the
    window where the whole batch decodes."""
    middle = (max(t[0] for t in runs) + min(t[-1] for t in runs)) / 2
    return round(float(np.mean([np.searchsorted(t, middle, side="right") for t in runs])))


def prefill_steps_bound(batch: int, context: int) -> int:
    """Steps a batch's prompts can take to all start decoding: one per 256 prompt tokens
    bounds every schedule measured here (chunks of 256 or more, or whole prompts)."""
    return -(-batch * context // 256)


def steady_steps(runs: list[list[float]], batch: int, context: int, wanted: int) -> np.ndarray:
    """Step times (seconds) of the window where every request of the batch decodes."""
    return np.concatenate(steady_windows(runs, batch, context, wanted))


def steady_windows(runs: list[list[float]], batch: int, context: int,
                   wanted: int) -> list[np.ndarray]:
    """``steady_steps`` per request, in order: consecutive step times of one stream."""
    start, end = max(t[0] for t in runs), min(t[-1] for t in runs)
    windows = [np.diff(inside[::STEP_WINDOW]) / STEP_WINDOW
               for t in runs if len(inside := [x for x in t if start <= x <= end]) > STEP_WINDOW]
    if sum(len(w) for w in windows) * STEP_WINDOW < wanted // 2:
        raise RuntimeError(f"decode batch {batch} x {context} tokens: the batch decoded "
                           f"together for under {wanted // 2} steps; raise --decode-steps")
    return windows


def lag_correlation(streams: list[np.ndarray], lag: int = 1) -> float | None:
    """Correlation of a step time (an ``STEP_WINDOW``-step mean) with the one ``lag`` later
    in the same stream, each over its stream's point's median: how long the host's slow
    stretches last. None with too few pairs to say."""
    pairs = [(w[:-lag], w[lag:]) for w in streams if len(w) > lag]
    if sum(len(a) for a, _ in pairs) < 3:
        return None
    first = np.concatenate([a for a, _ in pairs])
    later = np.concatenate([b for _, b in pairs])
    return float(np.corrcoef(first, later)[0, 1])


def workload(args, rng) -> list[SimRequest]:
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.requests))
    return [SimRequest(float(t), int(rng.choice(args.prompt_lens)),
                       int(rng.integers(args.min_output, args.max_output + 1)))
            for t in arrivals]


async def replay(session, url: str, requests: list[SimRequest], args, rng) -> list[dict]:
    start = time.monotonic()

    async def one(request: SimRequest) -> dict:
        await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
        body = {"model": args.model, "prompt": prompt(rng, request.input_len),
                "max_tokens": request.output_len, "ignore_eos": True}
        sent = time.monotonic()
        times = [t - start for t in await token_clock(session, url, body)]
        return {"ttft_s": times[0] - (sent - start),
                "tpot_s": (times[-1] - times[0]) / (request.output_len - 1), "times": times,
                "sent": sent - start}

    return await asyncio.gather(*(one(r) for r in requests))


async def measure_handoff(session, url: str, args, rng) -> dict:
    """``PromptRounds``: all ``--prompt-rounds`` rounds at once."""
    rounds = PromptRounds(session, url, args, rng)
    await rounds.take(args.prompt_rounds)
    return rounds.result()


class PromptRounds:
    """Through the gateway, one request at a time: how long after its first token (the
    prefill's, relayed at once) a request joins the decode batch - the gap to its second
    token's chunk less the decode steps that chunk carries (each the median of the
    request's later gaps) - and its TTFT (the replay's path: the gateway's hop, the
    prefill, the first token relayed). ``result``: the median per prompt length, every
    handoff sample (seconds: a median near zero leaves no ratio to speak of) and every
    TTFT over its length's median.

    Timed in rounds, each one prompt of every length, a few rounds at a time (``take``)
    between the calibration's other probes: the host runs slow in stretches of 1-3 s (the
    host meter on 16 dedicated cores: a third of its samples 1.5x slow), so five prompts of
    a length back to back (under a second) sat in one stretch, and their ratios to their
    own median left out the spread between stretches - the replay's prompts, minutes apart,
    spread twice as wide (an SD of 0.13-0.20 against 0.07-0.10 over 84bc590 and the three
    runs before it on that host), and the simulated TTFT P99 came short in three of four
    such runs. 15 rounds back to back (~10 s, c4c67d8) still spread half as wide as the
    replay (0.088 against 0.184), so since then ``calibrate`` spreads the rounds over the
    whole calibration, in ``CALIBRATION_PHASES`` groups (~2 minutes)."""

    def __init__(self, session, url: str, args, rng) -> None:
        self.session, self.url, self.rng = session, url, rng
        self.lengths = list(args.prompt_lens)
        self.body = {"model": args.model, "ignore_eos": True, "max_tokens": 2 + 2 * STEP_WINDOW}
        self.seconds: dict[int, list[float]] = {n: [] for n in self.lengths}
        self.ttfts: dict[int, list[float]] = {n: [] for n in self.lengths}

    async def take(self, rounds: int) -> None:
        for _ in range(rounds):
            for tokens in self.lengths:
                handoff_s, ttft_s = await first_alone_answer(self.session, self.url, self.body,
                                                             tokens, self.rng)
                self.seconds[tokens].append(handoff_s)
                self.ttfts[tokens].append(ttft_s)

    def result(self) -> dict:
        handoff: dict[str, list] = {"points": [], "samples": [], "ttft_points": [],
                                    "ttft_ratios": []}
        for tokens in self.lengths:
            seconds, ttfts = self.seconds[tokens], self.ttfts[tokens]
            handoff["points"].append({"tokens": tokens, "seconds": float(np.median(seconds))})
            handoff["samples"] += seconds
            median = float(np.median(ttfts))
            handoff["ttft_points"].append({"tokens": tokens, "seconds": median,
                                           "samples_s": ttfts})
            handoff["ttft_ratios"] += [x / median for x in ttfts]
        return handoff


async def warm_group(session, url: str, args, rng) -> dict:
    """Untimed rounds of ``PromptRounds`` through the gateway for ``--warmup-s`` seconds
    (at least one) before anything is timed: a fresh group ran its first prompts 2x slower
    for seconds (4381749, two runs on a 16-core host: the first three rounds of every
    length, 12 of the 60 samples the prompts' spread was drawn from, which took the
    simulated TTFT P99 76-79% over the measured one; the replay, after the calibration,
    never meets a fresh group). Returns the TTFTs (ms) per length, in order."""
    rounds, start = PromptRounds(session, url, args, rng), time.monotonic()
    await rounds.take(1)
    while time.monotonic() - start < args.warmup_s:
        await rounds.take(1)
    return {"seconds": time.monotonic() - start,
            "ttft_ms": {str(n): [t * 1e3 for t in ttfts] for n, ttfts in rounds.ttfts.items()}}


def round_groups(rounds: int, groups: int) -> list[int]:
    """``rounds`` split into ``groups`` as even as can be (the first ones the larger)."""
    return [rounds // groups + (i < rounds % groups) for i in range(groups)]


async def first_alone_answer(session, url: str, body: dict, tokens: int, rng,
                             tries: int = 8) -> tuple[float, float]:
    """An answer whose first token came alone in its chunk (the others leave no time of
    their own), within ``tries``: its handoff and TTFT."""
    for _ in range(tries):
        sent = time.monotonic()
        times = await token_clock(session, url, {**body, "prompt": prompt(rng, tokens)})
        sample = handoff_sample(times)
        if sample is not None:
            return sample, times[0] - sent
    raise RuntimeError(f"{tokens}-token prompts: no first token came alone in its chunk "
                       f"in {tries} answers")


async def measure_sharing(session, prefill_url: str, url: str, args, rng) -> dict:
    """How the two instances slow each other on the host's shared cores. Rounds in the
    order alone, beside, beside, alone (``--sharing-cycles`` times: drift of the host over
    the probe weighs both sides alike). Each round streams one answer through the gateway
    (the replay's path) at the replay's mean prompt length; in a round beside, prompts of
    the replay's lengths go to the prefill instance back to back from the answer's first
    token until its end, in a round alone two prompts of each length follow the answer.
    Decode: the answer's steps (``STEP_WINDOW``-step means, its first gap left out: the
    handoff) beside the prompts against alone; prefill: each prompt that ran wholly beside
    the answer over the median of its length alone."""
    context = int(np.mean(args.prompt_lens))
    body = {"model": args.model, "ignore_eos": True, "max_tokens": 2 * args.decode_steps}
    steps: dict[str, list[np.ndarray]] = {"alone": [], "beside": []}
    prompts: dict[str, list[tuple[int, float]]] = {"alone": [], "beside": []}
    for _ in range(args.sharing_cycles):
        for side in ("alone", "beside", "beside", "alone"):
            answer = {**body, "prompt": prompt(rng, context)}
            if side == "alone":
                steps[side].append(sharing_steps(await token_clock(session, url, answer), None))
                prompts[side] += await timed_prompts(session, prefill_url, args, rng)
            else:
                times, spans = await answer_beside_prompts(session, url, answer,
                                                           prefill_url, args, rng)
                steps[side].append(sharing_steps(times, (spans[0][1], spans[-1][2])))
                prompts[side] += [(n, end - sent) for n, sent, end in spans
                                  if times[1] <= sent and end <= times[-1]]
    return sharing_summary(steps, prompts, context + args.decode_steps)


async def timed_prompts(session, prefill_url: str, args, rng) -> list[tuple[int, float]]:
    """Two one-token completions of each prompt length, one at a time: (tokens, seconds)."""
    timed = []
    for tokens in args.prompt_lens * 2:
        _, sent, end = await timed_prompt(session, prefill_url, args, tokens, rng)
        timed.append((tokens, end - sent))
    return timed


async def timed_prompt(session, prefill_url: str, args, tokens: int,
                       rng) -> tuple[int, float, float]:
    body = {"model": args.model, "prompt": prompt(rng, tokens), "max_tokens": 1}
    sent = time.monotonic()
    async with session.post(prefill_url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{prefill_url}: {resp.status} {await resp.text()}")
        await resp.read()
    return tokens, sent, time.monotonic()


async def answer_beside_prompts(session, url: str, answer: dict, prefill_url: str, args,
                                rng) -> tuple[list[float], list[tuple[int, float, float]]]:
    """The answer's token times, and (tokens, sent, done) of every prompt sent beside it:
    back to back from its first token until it ends."""
    first_token, ended = asyncio.Event(), asyncio.Event()
    spans: list[tuple[int, float, float]] = []

    async def prompts_until_the_end() -> None:
        await first_token.wait()
        while not ended.is_set():
            tokens = int(rng.choice(args.prompt_lens))
            spans.append(await timed_prompt(session, prefill_url, args, tokens, rng))

    async def answer_stream() -> list[float]:
        times = await token_clock(session, url, answer, on_first=first_token.set)
        ended.set()
        return times

    times, _ = await asyncio.gather(answer_stream(), prompts_until_the_end())
    if not spans:
        raise RuntimeError("sharing probe: no prompt was sent beside the answer")
    return times, spans


async def measure_prefill_on_path(session, url: str, args, rng) -> dict:
    """Prompts on the replay's path beside a decode: the shared-cores probe's rounds
    (alone, beside, beside, alone, ``--sharing-cycles`` times), every prompt sent through
    the gateway as a two-token answer and timed to its first token. In a round alone two
    prompts of each length go one at a time; in a round beside, one answer of the
    replay's mean prompt length streams and, from its first token until its end, prompts
    of the replay's lengths follow each other, each sent as the one before hands back its
    first token (as the replay's arrive: beside a decode and beside the answer before
    them joining it). Each prompt that ran wholly beside the answer over the median of its
    length alone; only prompts whose first token came alone in its chunk count (the
    calibration's fit counts only those)."""
    context = int(np.mean(args.prompt_lens))
    body = {"model": args.model, "ignore_eos": True, "max_tokens": 2 * args.decode_steps}
    timed: dict[str, list[tuple[int, float]]] = {"alone": [], "beside": []}
    for _ in range(args.sharing_cycles):
        for side in ("alone", "beside", "beside", "alone"):
            if side == "alone":
                timed[side] += await path_prompts_alone(session, url, args, rng)
                continue
            answer = {**body, "prompt": prompt(rng, context)}
            timed[side] += await path_prompts_beside(session, url, answer, args, rng)
    medians = {n: float(np.median([t for m, t in timed["alone"] if m == n]))
               for n in sorted({n for n, _ in timed["alone"]})}
    beside = [t / medians[n] for n, t in timed["beside"] if n in medians]
    if not beside:
        raise RuntimeError("prompts on the replay's path: none timed beside a decode; raise "
                           "--decode-steps")
    return {"prefill_on_path_ms_alone": {str(n): m * 1e3 for n, m in medians.items()},
            "prefill_on_path_beside_decode_over_alone": {
                "samples": len(beside), **{f"p{q}": float(np.percentile(beside, q))
                                           for q in (10, 50, 90)}}}


def path_prompt_body(args, rng, tokens: int) -> dict:
    return {"model": args.model, "prompt": prompt(rng, tokens), "max_tokens": 2,
            "ignore_eos": True}


def first_token_alone(times: list[float]) -> bool:
    return len(times) > 1 and times[1] > times[0]


async def path_prompts_alone(session, url: str, args, rng) -> list[tuple[int, float]]:
    """Two prompts of each length through the gateway, one at a time: (tokens, TTFT)."""
    timed = []
    for tokens in args.prompt_lens * 2:
        sent = time.monotonic()
        times = await token_clock(session, url, path_prompt_body(args, rng, tokens))
        if first_token_alone(times):
            timed.append((tokens, times[0] - sent))
    return timed


async def path_prompts_beside(session, url: str, answer: dict, args,
                              rng) -> list[tuple[int, float]]:
    """(tokens, TTFT) of the prompts sent through the gateway beside the answer, each as
    the one before hands back its first token, that started after the answer's first
    token and handed back theirs before its last."""
    first_token, ended = asyncio.Event(), asyncio.Event()
    sent: list[tuple[int, float, asyncio.Task]] = []

    async def prompts_until_the_end() -> None:
        await first_token.wait()
        while not ended.is_set():
            tokens, got_first = int(rng.choice(args.prompt_lens)), asyncio.Event()
            task = asyncio.create_task(token_clock(
                session, url, path_prompt_body(args, rng, tokens), on_first=got_first.set))
            sent.append((tokens, time.monotonic(), task))
            waiting = asyncio.create_task(got_first.wait())
            await asyncio.wait((task, waiting), return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()

    async def answer_stream() -> list[float]:
        times = await token_clock(session, url, answer, on_first=first_token.set)
        ended.set()
        return times

    times, _ = await asyncio.gather(answer_stream(), prompts_until_the_end())
    answers = await asyncio.gather(*(task for _, _, task in sent))
    return [(tokens, mine[0] - at) for (tokens, at, _), mine in zip(sent, answers, strict=True)
            if first_token_alone(mine) and times[1] <= at and mine[0] <= times[-1]]


async def measure_idle_wake(session, url: str, args, rng) -> dict:
    """How much longer a prompt takes after the group idled: prompts of each length
    through the gateway (the replay's path, two-token answers, timed to their first
    token), ``--repeats`` rounds per length, each round a prompt back to back after the
    one before, then one after each pause of ``--idle-pauses-s`` (each pause followed by a
    prompt back to back again). Per pause and length, the median of the prompts after the
    pause less the median back to back; per pause a line in the prompt's tokens through
    those (least squares, nothing negative): the calibration's prompts run back to back,
    the replay's after idle cores. Only prompts whose first token came alone in its chunk
    count; one that did not is sent again (after the pause again), up to
    ``IDLE_PROBE_ATTEMPTS`` times, so a busy host's coalesced chunks do not leave a length
    without its sample. Every sample is kept (``samples``: tokens, pause or 0 back to back,
    seconds)."""
    samples: list[tuple[int, float, float]] = []
    for tokens in args.prompt_lens:
        for _ in range(args.repeats):
            for pause in args.idle_pauses_s:
                for after in (0.0, pause):
                    samples += [(tokens, after, t) for t in await prompt_timed_after(
                        session, url, args, rng, tokens, after)]
    return {"samples": samples, "points": idle_wake_points(samples, args.idle_pauses_s)}


# Sends of one idle-probe prompt at most: on a loaded host a two-token answer's first token
# can come in one chunk with the second and time nothing (in one test run on a 2-core host
# every prompt after one pause did, and the probe had no point for that pause).
IDLE_PROBE_ATTEMPTS = 4


async def prompt_timed_after(session, url: str, args, rng, tokens: int,
                             pause: float) -> list[float]:
    """``path_prompt_timed`` after ``pause`` seconds idle (0: back to back), sent again
    after the pause again until its first token comes alone, at most
    ``IDLE_PROBE_ATTEMPTS`` times; [] if it never did."""
    for _ in range(IDLE_PROBE_ATTEMPTS):
        await asyncio.sleep(pause)
        timed = await path_prompt_timed(session, url, args, rng, tokens)
        if timed:
            return timed
    return []


def idle_wake_points(samples: list[tuple[int, float, float]],
                     pauses: list[float]) -> list[list[float]]:
    """``IdleWake``'s points from the idle probe's samples (``measure_idle_wake``)."""
    def median(tokens: int, pause: float) -> float | None:
        times = [t for n, p, t in samples if n == tokens and p == pause]
        return float(np.median(times)) if times else None

    points = []
    for pause in pauses:
        extra = [(n, after - before) for n in sorted({n for n, _, _ in samples})
                 if (after := median(n, pause)) is not None
                 and (before := median(n, 0.0)) is not None]
        if not extra:
            raise RuntimeError(f"idle probe: no prompt length timed both back to back and "
                               f"after {pause} s")
        a = np.array([[1.0, n] for n, _ in extra])
        points.append([pause, *fit_nonnegative(a, [x for _, x in extra])])
    return points


async def path_prompt_timed(session, url: str, args, rng,
                            tokens: int) -> list[float]:
    """One prompt through the gateway: [TTFT], or [] where its first token came in one
    chunk with the next."""
    sent = time.monotonic()
    times = await token_clock(session, url, path_prompt_body(args, rng, tokens))
    return [times[0] - sent] if first_token_alone(times) else []


def sharing_steps(times: list[float], inside: tuple[float, float] | None) -> np.ndarray:
    """An answer's ``STEP_WINDOW``-step means (seconds) after its first gap, those wholly
    within ``inside`` (start, end) where given."""
    marks = times[1::STEP_WINDOW]
    return np.array([(b - a) / STEP_WINDOW for a, b in zip(marks, marks[1:], strict=False)
                     if inside is None or (inside[0] <= a and b <= inside[1])])


def first_over_later(answers: list[np.ndarray]) -> float | None:
    """Median first step mean of the answers over the median of their later ones."""
    answers = [w for w in answers if len(w) > 1]
    if not answers:
        return None
    later = np.concatenate([w[1:] for w in answers])
    return float(np.median([w[0] for w in answers]) / np.median(later))


def sharing_summary(steps: dict[str, list[np.ndarray]],
                    prompts: dict[str, list[tuple[int, float]]], context: int) -> dict:
    """The probe's figures (``SharedCores.from_probe`` reads its medians), and how the
    alone answers' step means (through the gateway, as the replay's) spread and hold."""
    alone = np.concatenate(steps["alone"])
    by_length: dict[int, list[float]] = {}
    for tokens, seconds in prompts["alone"]:
        by_length.setdefault(tokens, []).append(seconds)
    medians = {n: float(np.median(v)) for n, v in by_length.items()}
    beside = [seconds / medians[n] for n, seconds in prompts["beside"]]
    if not len(alone) or not sum(map(len, steps["beside"])) or not beside:
        raise RuntimeError("sharing probe: no decode step or no prompt timed beside the "
                           "other side; raise --decode-steps")
    return {"context": context,
            "decode_step_ms_alone": ms_percentiles(alone.tolist()),
            "decode_step_ms_beside_prefill": ms_percentiles(
                np.concatenate(steps["beside"]).tolist()),
            # the answer's first 8 steps after it joined against its later ones
            "alone_first_steps_over_later": first_over_later(steps["alone"]),
            "alone_step_lag_correlation": {
                f"{lag * STEP_WINDOW}_steps": lag_correlation(steps["alone"], lag)
                for lag in (1, 2, 4)},
            "prefill_ms_alone": {str(n): m * 1e3 for n, m in sorted(medians.items())},
            "prefill_beside_decode_over_alone": {
                "samples": len(beside), **{f"p{q}": float(np.percentile(beside, q))
                                           for q in (10, 50, 90)}}}


def handoff_sample(times: list[float]) -> float | None:
    """From one answer's token times: its first token's chunk until its join; None where
    the first token came in one chunk with later ones (its text held back as incomplete
    UTF-8: the tiny model's random ids), which leaves no time of its own."""
    if times[1] == times[0]:
        return None
    steps = np.diff(times[1:])
    carried = times.count(times[1])  # tokens in the second token's chunk: a step each
    return times[1] - times[0] - carried * float(np.median(steps[steps > 0]))


def decode_timing(rows: list[dict]) -> dict:
    """Where the measured TPOTs go (milliseconds): each request's first gap (its handoff to
    the decode instance and its first step there; requests whose first token came alone in
    its chunk) against its later steps, the TPOT without that first gap, and the later
    steps of a request during which another joined the batch (the step whose end is nearest
    the newcomer's second token) against those shared with a request already running and
    those alone - alone in the batch while another request waited for its first token (the
    prefill instance busy on the same host's cores, when rows carry ``sent``) or not."""
    joins = [r["times"][1] for r in rows]
    kinds: dict[str, list[float]] = {"join": [], "shared": [], "alone_beside_prefill": [],
                                     "alone": []}
    for row in rows:
        times = np.asarray(row["times"])
        ends, gaps = times[2:], np.diff(times[1:])
        joined = {int(np.argmin(np.abs(ends - t))) for t in joins
                  if times[1] < t <= times[-1]}
        for i, gap in enumerate(gaps):
            kinds[step_kind(row, rows, ends[i] - gap, ends[i], i in joined)].append(gap)
    steady_tpot = [(r["times"][-1] - r["times"][1]) / (len(r["times"]) - 2) for r in rows]
    alone = [r["times"] for r in rows if r["times"][1] > r["times"][0]]
    return {"first_gap_ms": ms_percentiles([t[1] - t[0] for t in alone]),
            "later_step_ms": ms_percentiles([g for k in kinds.values() for g in k]),
            "tpot_without_first_gap_ms": ms_percentiles(steady_tpot),
            **{f"later_step_{kind}_ms": ms_percentiles(gaps) for kind, gaps in kinds.items()}}


def step_kind(row: dict, rows: list[dict], start: float, end: float, joined: bool) -> str:
    if joined:
        return "join"
    others = [r for r in rows if r is not row]
    if any(r["times"][1] < end and r["times"][-1] > start for r in others):
        return "shared"
    if any(r.get("sent", r["times"][0]) < end and r["times"][0] > start for r in others):
        return "alone_beside_prefill"
    return "alone"


def ms_percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"samples": 0}
    return {"samples": len(seconds), **{f"p{q}": float(np.percentile(seconds, q)) * 1e3
                                        for q in (50, 90, 99)}}


def percentiles(rows: list[dict], key: str) -> dict:
    """P50 / P99 of ``key`` over the rows. Rows of several draws of the spread (``draw``
    set): each draw's percentiles over its own requests, as the measured ones are over the
    one replay's, and their median over the draws, with the percentiles of every draw's
    rows pooled beside (``pooled``). The pooled P99 of 10 draws of 100 requests is about their
    eleventh-slowest row, where the measured one lies between one run's two slowest: one
    request that queued in every draw filled the pooled tail, and the P99 came from the
    next request's slowest draw (156c086, run 1: 259 ms pooled, 239 ms the draws' median,
    235 ms measured)."""
    values = [r[key] for r in rows]
    pooled = {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}
    draws: dict[int, list[float]] = {}
    for row in rows:
        if "draw" in row:
            draws.setdefault(row["draw"], []).append(row[key])
    if len(draws) < 2:
        return pooled
    each = np.array([[np.percentile(v, q) for q in (50, 99)] for v in draws.values()])
    p50, p99 = np.median(each, axis=0)
    return {"p50": float(p50), "p99": float(p99), "pooled": pooled}


def simulate(model: LatencyModel, requests: list[SimRequest], args,
             noise: ServiceNoise | None = None, cores: SharedCores | None = None,
             steps: PrefillSteps | None = None, wake: IdleWake | None = None) -> list[dict]:
    sim = GroupSim(model, 1, 1, ttft_slo_s=args.ttft_slo_s, max_wait_s=args.max_wait_s,
                   noise=noise, shared_cores=cores, prefill_steps=steps, idle_wake=wake)
    fresh = [SimRequest(r.arrival, r.input_len, r.output_len) for r in requests]
    return [{"ttft_s": r.first_token - r.arrival,
             "tpot_s": (r.finished - r.first_token) / (r.output_len - 1)}
            for r in sim.run(fresh)]


def affinity(server: ServeProcess) -> list[int]:
    """The cores an instance's server process may run on (its engine process inherits
    them)."""
    return sorted(os.sched_getaffinity(server.process.pid))


async def run(args) -> dict:
    from aiohttp import ClientSession, ClientTimeout

    from pdserve.cluster.app import stop_gateway

    load_average = {"start": os.getloadavg()[0]}
    cpu_marks = [cpu_times()]
    prefill, decode = start_instances(args)
    meters, phase_marks = HostMeters(args), {}
    if (gateway_cores := client_cores(args)) is not None:
        os.sched_setaffinity(0, gateway_cores)  # the gateway runs in this thread
    pinned = {"prefill": affinity(prefill), "decode": affinity(decode),
              "gateway_and_client": sorted(os.sched_getaffinity(0))}
    rng = np.random.default_rng(args.seed)
    try:
        async with ClientSession(timeout=ClientTimeout(total=None)) as session:
            gateway, url = await start_group(session, prefill, decode, args)
            try:
                prefill_steps = await prefill_steps_of(session, prefill)
                cpu_marks.append(cpu_times())
                phase_marks["calibration"] = time.monotonic()
                calibrated = await calibrate(session, prefill, decode, url, args, rng)
                requests = workload(args, rng)
                load_average["calibrated"] = os.getloadavg()[0]
                cpu_marks.append(cpu_times())
                replay_mark = phase_marks["replay"] = time.monotonic()
                measured = await replay(session, url, requests, args, rng)
                cpu_marks.append(cpu_times())
                steps = {role: await instance_steps(session, server, replay_mark)
                         for role, server in (("prefill", prefill), ("decode", decode))}
                after = None
                phase_marks["recalibration"] = time.monotonic()
                if args.decode_rounds_after > 0:
                    after = await recalibrate(session, prefill, url, args)
                    cpu_marks.append(cpu_times())
            finally:
                await stop_gateway(*gateway)
    finally:
        host_meter = meters.stop(phase_marks.get("replay", time.monotonic()), phase_marks)
        for server in (prefill, decode):
            server.stop()
    load_average["replayed"] = os.getloadavg()[0]
    host_cpu = {"calibration": cpu_shares(cpu_marks[1], cpu_marks[2]),
                "replay": cpu_shares(cpu_marks[2], cpu_marks[3])}
    model, ratios = calibrated.pop("model"), calibrated.pop("ratios")
    recalibration = None
    if after is not None:
        host_cpu["recalibration"] = cpu_shares(cpu_marks[3], cpu_marks[4])
        before = calibrated["service_points"]
        both_sides = fitted_model(bracketed(before, after), args)
        recalibration = {"service_points": after, "drift": drift(before, after),
                         "latency_model_both_sides": dataclasses.asdict(both_sides)}
    cores, wake = calibrated.pop("shared_cores"), calibrated.pop("idle_wake")
    parts = GroupParts(cores, calibrated["decode_hold_probability"], prefill_steps, wake,
                       direct_prompt_slowdown(calibrated["shared_cores_probe"]))
    prefill_busy = sum(model.prefill_s(r.input_len) for r in requests) / requests[-1].arrival
    host_speed = replay_host_speed(host_meter)
    engine_speed = replay_decode_engine_speed(steps, model)
    replayed = [[r.arrival, r.input_len, r.output_len] for r in requests]
    token_times = [r["times"] for r in measured]
    simulated = simulations(model, parts, ratios, requests, args, recalibration=recalibration,
                            host_speed=host_speed, decode_engine_speed=engine_speed,
                            replay_prompt_ratios=replay_prompt_ratios(replayed, token_times))
    result = {**calibrated, "service_spread": {k: spread(v) for k, v in ratios.items()},
            "prefill_steps": dataclasses.asdict(prefill_steps),  # how it steps
            "service_ratios": ratios,  # what the simulations drew from: re-simulable
            "latency_model": dataclasses.asdict(model),
            "shared_cores": dataclasses.asdict(cores), "prefill_utilisation": prefill_busy,
            "idle_wake": dataclasses.asdict(wake),
            "host_load_average_1min": load_average,  # other work on the cores skews both
            "host_cpu": host_cpu,
            "cores": pinned,  # each process's allowed cores (one torch thread each)
            # the points timed after the replay, how far they moved, and the model
            # fitted to both sides' points pooled
            "recalibration": recalibration,
            "measured_decode_timing": decode_timing(measured),
            # every request's token arrivals (s from the replay's start): re-analysable
            "measured_token_times_s": [[round(t, 5) for t in r["times"]] for r in measured],
            # the request list (arrival s, prompt and answer tokens): re-simulable
            "requests": replayed,
            # each instance's engine steps during the replay (s from its start) and, per
            # request, its TPOT against the decode steps that ran while it decoded
            "replay_steps": steps,
            # this host's time.monotonic() when the replay began: lines the steps up with
            # anything else recorded on the host meanwhile
            "replay_started_monotonic_s": replay_mark,
            # a fixed CPU workload timed on each instance's core throughout (None: off)
            "host_meter": host_meter,
            "replay_steps_check": steps_check(steps, measured, model),
            "replay_host_speed": host_speed,
            "replay_decode_engine_speed": engine_speed,
            "compare": compare(measured, simulated)}
    result["prompt_spread"] = prompt_spread(result, simulated["simulated_medians_only"])
    return result


STEP_FIELDS = ("t", "mode", "decode_batch", "decode_context_tokens", "prefill_tokens",
               "measured_cycle_ms")


async def engine_timeline_since(session, base_url: str, since: float) -> list[dict]:
    """A server's engine timeline entries since ``since`` (this host's ``time.monotonic()``,
    the clock the engine's timeline keeps): a multiplexing engine's decisions, a chunked
    one's steps."""
    async with session.get(base_url + "/v1/engine/timeline",
                           params={"since": repr(since)}) as resp:
        return (await resp.json())["entries"]


async def instance_steps(session, server: ServeProcess, since: float) -> dict:
    """An instance's engine steps since ``since``, one row of ``STEP_FIELDS`` each, ``t``
    in seconds from ``since``."""
    entries = await engine_timeline_since(session, server.url, since)
    rows = [[round(e["time"] - since, 5), e["mode"], e["decode_batch"],
             e["decode_context_tokens"], e["prefill_tokens"], round(e["measured_cycle_ms"], 3)]
            for e in entries]
    return {"fields": list(STEP_FIELDS), "rows": rows}


def step_rows(part: dict) -> list[dict]:
    """An instance's recorded steps (``instance_steps``: ``fields`` and ``rows``), one dict
    per step."""
    return [dict(zip(part["fields"], row, strict=True)) for row in part["rows"]]


def steps_check(steps: dict, measured: list[dict], model: LatencyModel) -> dict:
    """Whether a slow request was slow in the decode instance's engine or on the way to
    the client: per request, its TPOT (from its second token: the first gap is the
    hand-off) over the mean time of the decode instance's steps between its second and
    last token, and those steps' mean over the model's decode step for their batch and
    context; percentiles of both over all requests and for the slowest 5% by TPOT."""
    decode = [r for r in step_rows(steps["decode"]) if r["decode_batch"] > 0]
    per_request = []
    for request in measured:
        times = request["times"]
        if len(times) < 4:
            continue
        during = [r for r in decode if times[1] <= r["t"] <= times[-1]]
        if not during:
            continue
        tpot_ms = (times[-1] - times[1]) / (len(times) - 2) * 1e3
        step_ms = float(np.mean([r["measured_cycle_ms"] for r in during]))
        model_ms = float(np.mean([model.decode_step_s(r["decode_batch"],
                                                      r["decode_context_tokens"]) * 1e3
                                  for r in during]))
        per_request.append((tpot_ms, tpot_ms / step_ms, step_ms / model_ms))
    if not per_request:
        return {"requests": 0}
    per_request.sort()
    slowest = per_request[-max(1, len(per_request) // 20):]
    summary = lambda values: {f"p{q}": float(np.percentile(values, q)) for q in (10, 50, 90)}
    return {"requests": len(per_request),
            "tpot_over_engine_steps": summary([r[1] for r in per_request]),
            "engine_steps_over_model": summary([r[2] for r in per_request]),
            "slowest_5pct": {"tpot_ms": summary([r[0] for r in slowest]),
                             "tpot_over_engine_steps": summary([r[1] for r in slowest]),
                             "engine_steps_over_model": summary([r[2] for r in slowest])}}


def direct_prompt_slowdown(probe: dict) -> float | None:
    """The shared-cores probe's factor of prompts sent straight to the prefill instance,
    where it also timed prompts on the replay's path (which ``SharedCores`` then takes)."""
    if "prefill_on_path_beside_decode_over_alone" not in probe:
        return None
    return probe["prefill_beside_decode_over_alone"]["p50"]


class GroupParts(NamedTuple):  # not a dataclass: the tests load this script unregistered
    """What the calibration fitted beside the latency model and its spread: the shared
    cores' factors, how long slow stretches hold, the prefill instance's steps, the extra
    of a prompt after idleness, and the factor of prompts sent straight to the prefill
    instance beside a decode (the probe's before prompts were timed on the replay's
    path; None where the run did not time both)."""

    cores: SharedCores | None
    hold: float
    steps: PrefillSteps | None
    wake: IdleWake | None = None
    direct_prompt_slowdown: float | None = None


def simulations(model: LatencyModel, parts: GroupParts, ratios: dict[str, list[float]],
                requests: list[SimRequest], args, recalibration: dict | None = None,
                host_speed: dict[str, float] | None = None,
                decode_engine_speed: float | None = None,
                replay_prompt_ratios: list[float] | None = None) -> dict[str, list[dict]]:
    """The fitted group with the measured spread, and each without one of its parts (and,
    with ``recalibration``, the model fitted to both sides of the replay; with
    ``host_speed``, the model at the host's speed in the replay; with
    ``decode_engine_speed``, its decode steps at the speed the decode engine's own steps
    ran in the replay: in-sample, a check of the group's composition, not a prediction;
    with ``replay_prompt_ratios``, the prompts drawn from the replay's own spread:
    in-sample too, whether the spread is what the TTFT tail misses). With the spread,
    the requests' results of ``--draws`` draws, each row marked with its draw: one draw's
    P99 of 100 requests moved by up to 20% from seed to seed, so ``percentiles`` takes the
    median over the draws."""
    def drawn(model: LatencyModel = model, spread: dict = ratios, **changes) -> list[dict]:
        p = parts._replace(**changes)
        return [{**row, "draw": draw} for draw in range(args.draws) for row in simulate(
            model, requests, args, noise(spread, args, p.hold, args.seed + draw), p.cores,
            p.steps, p.wake)]

    without = dataclasses.replace(model, handoff_base_s=0.0, handoff_per_token_s=0.0)
    result = {"simulated": drawn(),
              "simulated_medians_only": simulate(model, requests, args, cores=parts.cores,
                                                 steps=parts.steps, wake=parts.wake),
              "simulated_without_handoff": drawn(without),
              "simulated_without_shared_cores": drawn(cores=None),
              "simulated_without_held_stretches": drawn(hold=0.0),
              "simulated_without_prefill_steps": drawn(steps=None)}
    if model.gateway_hop_s > 0.0:  # the hop charged to the prefill instance, as before
        result["simulated_without_gateway_hop"] = drawn(model.without_gateway_hop())
    if parts.wake is not None:
        result["simulated_without_idle_wake"] = drawn(wake=None)
    if host_speed is not None:
        result["simulated_at_replay_host_speed"] = drawn(
            model.at_speed(host_speed["prefill"], host_speed["decode"]))
    if decode_engine_speed is not None:
        result["simulated_at_replay_decode_engine_speed"] = drawn(
            model.at_speed(1.0, decode_engine_speed))
    if recalibration is not None:
        result["simulated_calibrated_both_sides"] = drawn(
            LatencyModel(**recalibration["latency_model_both_sides"]))
    # Prompts drawn from the decode steps' spread: the same host's slow stretches over
    # ~1,000 timed blocks, where the prompts' own spread has 5 per length and no tail.
    result["simulated_with_prefill_host_spread"] = drawn(
        spread={**ratios, "prefill": ratios["decode_step"]})
    if parts.cores is not None and parts.direct_prompt_slowdown is not None:
        direct = dataclasses.replace(parts.cores,
                                     prefill_slowdown=parts.direct_prompt_slowdown)
        result["simulated_with_direct_prompt_factor"] = drawn(cores=direct)
    if replay_prompt_ratios:
        result["simulated_with_replay_prompt_spread"] = drawn(
            spread={**ratios, "prefill": replay_prompt_ratios})
    return result


def replay_prompt_ratios(requests: list[list], token_times: list[list[float]]) -> list[float]:
    """Each replayed request's TTFT over the median of its prompt length's: the spread of
    the prompts through the replay, as the calibration's ratios are taken."""
    ttfts: dict[int, list[float]] = {}
    for (arrival, tokens, _), times in zip(requests, token_times, strict=True):
        ttfts.setdefault(int(tokens), []).append(times[0] - arrival)
    return [t / float(np.median(by_length)) for by_length in ttfts.values() for t in by_length]


def prompt_spread(run: dict, rows: list[dict]) -> dict:
    """The prompts' spread as the simulations drew it (the calibration's TTFT ratios) and
    as the replay's prompts spread (``replay_prompt_ratios``): standard deviations; and how
    far each replayed first token over its simulated one (``rows``: medians only) follows
    the host meter on the prefill instance's core - its reading over the calibration's
    median, averaged over the samples from 0.5 s before the request to 0.5 s after its
    first token: their correlation (None without a meter)."""
    replayed = replay_prompt_ratios(run["requests"], run["measured_token_times_s"])
    result = {"calibration_sd": float(np.std(run["service_ratios"]["prefill"])),
              "calibration_samples": len(run["service_ratios"]["prefill"]),
              "replay_sd": float(np.std(replayed)), "replay_samples": len(replayed),
              "first_token_over_simulated_vs_meter_correlation": None}
    samples = ((run.get("host_meter") or {}).get("samples") or {}).get("prefill")
    if not samples:
        return result
    meter = np.array(samples)
    before = meter[meter[:, 0] < 0, 1]  # the calibration ran before the replay's start
    base = float(np.median(before if before.size else meter[:, 1]))
    over, reading = [], []
    for (arrival, _, _), times, row in zip(run["requests"], run["measured_token_times_s"],
                                           rows, strict=True):
        near = meter[(meter[:, 0] >= arrival - 0.5) & (meter[:, 0] <= times[0] + 0.5), 1]
        if near.size:
            over.append((times[0] - arrival) / row["ttft_s"])
            reading.append(float(near.mean()) / base)
    if len(over) > 2:
        result["first_token_over_simulated_vs_meter_correlation"] = float(
            np.corrcoef(over, reading)[0, 1])
    return result


async def prefill_steps_of(session, prefill: ServeProcess) -> PrefillSteps:
    """How the prefill instance steps through prompts, from what its engine reports: the
    chunked policy's budget, and whether a step's tokens come back only after the next
    step ran (overlap scheduling where issuing a step runs it: not on a CUDA device)."""
    info = await (await session.get(prefill.url + "/v1/engine/info")).json()
    if info.get("schedule") != "chunked":
        raise RuntimeError(f"the prefill instance runs --schedule {info.get('schedule')}: the "
                           "simulator models a chunked prefill instance's steps only")
    late = info["overlap_schedule"]["enabled"] and not info["device"].startswith("cuda")
    return PrefillSteps(info["chunk_size"], tokens_one_step_late=late)


def resimulate(path: str, args, steps: PrefillSteps | None) -> dict:
    """A recorded run's measured percentiles against the simulations of today's code, from
    its recorded model, factors, spread and requests. ``steps``: the prefill instance's
    steps where the run did not record them."""
    run = load_json(path)  # committed runs are gzip-compressed (.json.gz)
    if args.skip_prompt_rounds:
        run = without_first_prompt_rounds(run, args.skip_prompt_rounds)
    if "prefill_steps" in run:
        steps = PrefillSteps(**run["prefill_steps"])
    if steps is None:
        raise SystemExit(f"{path} records no prefill_steps: name what its prefill instance "
                         "ran with --assume-prefill-steps CHUNK[,late]")
    requests = [SimRequest(float(a), int(n), int(o)) for a, n, o in run["requests"]]
    wake = run.get("idle_wake")  # recorded since the idle probe
    parts = GroupParts(SharedCores(**run["shared_cores"]), run["decode_hold_probability"],
                       steps, None if wake is None else idle_wake_of(wake),
                       direct_prompt_slowdown(run.get("shared_cores_probe", {})))
    model, recalibration = recorded_model(run), run.get("recalibration")
    if recalibration and "latency_model_before_replay" in recalibration:
        # 156c086-bcc1c68 recorded the both-sides model as their model
        model = LatencyModel(**recalibration["latency_model_before_replay"])
        recalibration = {**recalibration, "latency_model_both_sides": run["latency_model"]}
    recorded = model
    if args.refit:
        model, recalibration = refitted(run, args)
    host_speed = replay_host_speed(run.get("host_meter"))
    engine_speed = replay_decode_engine_speed(run.get("replay_steps"), model)
    replayed = (replay_prompt_ratios(run["requests"], run["measured_token_times_s"])
                if "measured_token_times_s" in run else None)
    simulated = simulations(model, parts, run["service_ratios"], requests, args,
                            recalibration=recalibration, host_speed=host_speed,
                            decode_engine_speed=engine_speed,
                            replay_prompt_ratios=replayed)
    measured = {key: run["compare"][key]["measured"] for key in ("ttft_s", "tpot_s")}
    result = {"resimulated": path, "recorded_revision": run.get("git_revision"),
              "skipped_prompt_rounds": args.skip_prompt_rounds,
              "prefill_steps": dataclasses.asdict(steps), "refit": args.refit,
              "replay_host_speed": host_speed,
              "replay_decode_engine_speed": engine_speed,
              "latency_model": dataclasses.asdict(model),
              "compare": compare_percentiles(measured, simulated)}
    if args.refit:
        result["latency_model_recorded"] = dataclasses.asdict(recorded)
    if "replay_steps" in run:
        result["replay_decode_steps_over_model"] = {
            "recorded": decode_steps_over_model(run["replay_steps"], recorded),
            **({"refitted": decode_steps_over_model(run["replay_steps"], model)}
               if args.refit else {})}
    if "measured_token_times_s" in run:
        unwoken = simulate(model, requests, args, cores=parts.cores, steps=steps)
        result["first_token_over_simulated"] = first_token_ratios(
            run, simulated["simulated_medians_only"])
        result["first_token_over_simulated_without_idle_wake"] = first_token_ratios(
            run, unwoken)
        result["prompt_spread"] = prompt_spread(run, simulated["simulated_medians_only"])
    return result


def without_first_prompt_rounds(run: dict, rounds: int) -> dict:
    """The run as if its first ``rounds`` rounds of prompts through the gateway had been
    untimed: each length's TTFT samples without them, its median and the prompts' ratios
    taken again (a check of what a warm-up would have changed, in-sample; the handoff
    points stay as recorded)."""
    points, ratios = [], []
    for point in run["service_points"]["prefill"]:
        samples = point["samples_s"][rounds:]
        if not samples:
            raise SystemExit(f"--skip-prompt-rounds {rounds}: {point['tokens']} tokens has "
                             f"only {len(point['samples_s'])} samples")
        median = float(np.median(samples))
        points.append({**point, "seconds": median, "samples_s": samples})
        ratios += [x / median for x in samples]
    return {**run, "service_points": {**run["service_points"], "prefill": points},
            "service_ratios": {**run["service_ratios"], "prefill": ratios}}


def refitted(run: dict, args) -> tuple[LatencyModel, dict | None]:
    """The model, and the both-sides model where the run timed points after its replay,
    fitted again from the run's recorded service points by today's fit (with the model
    preset, link and KV room the run was configured with; ``args``' where it records
    none)."""
    points = run["service_points"]
    missing = {"prefill", "prefill_direct", "decode", "handoff"} - set(points)
    if missing:
        raise SystemExit(f"--refit: the run records no {', '.join(sorted(missing))} points")
    config = run.get("config", {})
    fit_args = argparse.Namespace(**{key: config.get(key, getattr(args, key)) for key in
                                     ("model", "link_gb_per_s", "decode_kv_tokens")})
    model, recalibration = fitted_model(points, fit_args), run.get("recalibration")
    if recalibration:
        both_sides = fitted_model(bracketed(points, recalibration["service_points"]),
                                  fit_args)
        recalibration = {**recalibration,
                         "latency_model_both_sides": dataclasses.asdict(both_sides)}
    return model, recalibration


def decode_steps_over_model(steps: dict, model: LatencyModel) -> dict:
    """The decode instance's replayed decode-only steps over the model's step for their
    batch and context: percentiles, and the median per batch size."""
    rows = [r for r in step_rows(steps["decode"])
            if r["mode"] == "decode_only" and r["decode_batch"] > 0]
    if not rows:
        return {"steps": 0}
    ratios = np.array([r["measured_cycle_ms"] / (1e3 * model.decode_step_s(
        r["decode_batch"], r["decode_context_tokens"])) for r in rows])
    batches = np.array([r["decode_batch"] for r in rows])
    return {"steps": len(rows),
            **{f"p{q}": float(np.percentile(ratios, q)) for q in (10, 50, 90)},
            "p50_by_batch": {str(b): {"steps": int((batches == b).sum()),
                                      "p50": float(np.median(ratios[batches == b]))}
                             for b in sorted(set(batches.tolist()))}}


def recorded_model(run: dict) -> LatencyModel:
    """A run's fitted model; for a run from before the gateway hop was fitted, with it
    fitted now from the run's recorded prompt points (through the gateway and straight
    at the prefill instance)."""
    model = LatencyModel(**run["latency_model"])
    points = run.get("service_points", {})
    if "gateway_hop_s" not in run["latency_model"] and "prefill_direct" in points:
        model = model.fit_gateway_hop(points["prefill"], points["prefill_direct"])
    return model


def first_token_ratios(run: dict, rows: list[dict]) -> dict:
    """Each replayed request's measured first token over its simulated one (``rows``, in
    the request list's order), median and range per prompt length, apart for requests
    that arrived while another decoded (between its first and last token) and the rest."""
    times = run["measured_token_times_s"]
    kinds: dict[str, dict[int, list[float]]] = {"nothing_decoding": {}, "beside_decode": {}}
    for i, ((arrival, tokens, _), row) in enumerate(zip(run["requests"], rows, strict=True)):
        beside = any(t[0] < arrival < t[-1] for j, t in enumerate(times) if j != i)
        ratio = (times[i][0] - arrival) / row["ttft_s"]
        kinds["beside_decode" if beside else "nothing_decoding"].setdefault(
            int(tokens), []).append(ratio)
    return {kind: {str(n): {"requests": len(r), "median": float(np.median(r)),
                            "min": min(r), "max": max(r)}
                   for n, r in sorted(by_length.items())}
            for kind, by_length in kinds.items()}


def idle_wake_of(recorded: dict) -> IdleWake:
    """An ``IdleWake`` from its JSON record (its points written as lists; at 0f6f674 an
    extra per pause whatever the prompt's length: ``(idle_s, extra_s)``)."""
    return IdleWake(tuple((float(p[0]), float(p[1]), float(p[2]) if len(p) > 2 else 0.0)
                          for p in recorded["points"]))


def rising_seconds(text: str) -> list[float]:
    """Comma-separated seconds above 0, rising (--idle-pauses-s)."""
    values = [float(x) for x in text.split(",")]
    if values[0] <= 0 or sorted(set(values)) != values:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, rising, not {text!r}")
    return values


def assumed_steps(text: str) -> PrefillSteps:
    """``CHUNK`` or ``CHUNK,late`` (--assume-prefill-steps)."""
    chunk, _, late = text.partition(",")
    if late not in ("", "late"):
        raise argparse.ArgumentTypeError(f"expected CHUNK or CHUNK,late, not {text!r}")
    return PrefillSteps(int(chunk), tokens_one_step_late=late == "late")


def cpu_times() -> list[int] | None:
    """The host's CPU time so far (``/proc/stat``'s ``cpu`` line, in ticks); None off Linux."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None


def cpu_shares(before: list[int] | None, after: list[int] | None) -> dict:
    """Over a stretch: the share of the host's CPU time busy (anything but idle and I/O
    wait) and stolen by the hypervisor (other machines on the same cores)."""
    if before is None or after is None:
        return {}
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent[:8]) or 1  # user .. steal; guest time is counted within user
    idle = spent[3] + spent[4]
    return {"busy": (total - idle) / total, "steal": spent[7] / total}


async def start_group(session, prefill: ServeProcess, decode: ServeProcess, args):
    """The real gateway in front of the two instances; returns it and its completions URL."""
    from pdserve.cluster.app import start_gateway
    from pdserve.cluster.config import GatewayConfig
    from pdserve.cluster.registry import Instance, MemoryRegistry

    registry = MemoryRegistry()
    for name, server, role in (("p", prefill, "prefill"), ("d", decode, "decode")):
        info = await (await session.get(server.url + "/pd/info")).json()
        registry.register(Instance(name, "default", role, f"127.0.0.1:{server.port}",
                                   info["kv_address"], info["model"]))
    port = free_port()
    config = GatewayConfig(host="127.0.0.1", port=port, ttft_slo_ms=args.ttft_slo_s * 1e3,
                           max_wait_s=args.max_wait_s)
    gateway = await start_gateway(config, registry)
    return gateway, f"http://127.0.0.1:{port}/v1/completions"


async def calibrate(session, prefill: ServeProcess, decode: ServeProcess, url: str, args,
                    rng) -> dict:
    """Service times over HTTP, the model fitted to them, and each one's spread. The model
    is fitted to what the replay's path gives (through the gateway, as the replay sends its
    requests): prefill to the TTFTs of the handoff's answers, decode to steps of answers
    streamed through the gateway (a gateway relaying the tokens on the same cores slows
    them); prompts timed straight at the prefill instance are kept beside."""
    # Prompts of their own: the replay's request list stays the one earlier runs drew.
    warmup = await warm_group(session, url, args, np.random.default_rng(args.seed + 6))
    prompts = PromptRounds(session, url, args, np.random.default_rng(args.seed + 1))
    groups = iter(round_groups(args.prompt_rounds, CALIBRATION_PHASES))
    await prompts.take(next(groups))
    direct_points, _ = await measure_prefill(session, prefill.url + "/v1/completions", args,
                                             rng)
    decode_points, decode_ratios = await measure_decode_rounds(
        session, url, args, rng, interpolated_seconds(direct_points), args.decode_rounds,
        warmup=args.decode_warmup_rounds)
    await prompts.take(next(groups))
    sharing = await measure_sharing(session, prefill.url + "/v1/completions", url, args,
                                    np.random.default_rng(args.seed + 2))
    await prompts.take(next(groups))
    sharing.update(await measure_prefill_on_path(session, url, args,
                                                 np.random.default_rng(args.seed + 3)))
    await prompts.take(next(groups))
    wake = await measure_idle_wake(session, url, args, np.random.default_rng(args.seed + 4))
    await prompts.take(next(groups))
    handoff = prompts.result()
    points = {"prefill": handoff["ttft_points"], "decode": decode_points,
              "handoff": handoff["points"], "prefill_direct": direct_points}
    model = fitted_model(points, args)
    # The fitted step at the probe's context, against the probe's alone steps.
    sharing["fitted_step_ms"] = model.decode_step_s(1, sharing["context"]) * 1e3
    return {"warmup": warmup, "service_points": points,
            "handoff_samples_ms": ms_percentiles(handoff["samples"]),
            "shared_cores_probe": sharing,
            "idle_probe": wake,
            "decode_step_lag_correlation": {
                f"{lag * STEP_WINDOW}_steps": lag_correlation(decode_ratios, lag)
                for lag in (1, 2, 4)},
            "model": model,
            "shared_cores": SharedCores.from_probe(sharing),
            "idle_wake": IdleWake(tuple((p, base, per_token)
                                        for p, base, per_token in wake["points"])),
            "decode_hold_probability": held_stretches(sharing),
            "ratios": {"prefill": handoff["ttft_ratios"],
                       "decode_step": np.concatenate(decode_ratios).tolist()}}


CALIBRATION_PHASES = 5
"""Where ``calibrate`` times a group of prompt rounds: first, after the decode rounds,
after the shared-cores probe, after the prompts on the path, after the idle probe."""


def interpolated_seconds(points: list[dict]) -> Callable[[int], float]:
    """A prompt's time by its length, between measured ``{"tokens", "seconds"}``."""
    lengths = [p["tokens"] for p in points]
    seconds = [p["seconds"] for p in points]
    return lambda tokens: float(np.interp(tokens, lengths, seconds))


def fitted_model(points: dict[str, list[dict]], args) -> LatencyModel:
    """The latency model fitted to service points: prefill to the first tokens through the
    gateway, decode to the steps, the handoff, and the gateway's hop against the prompts
    sent straight at the prefill instance."""
    model = LatencyModel.fit(points["prefill"], points["decode"], kv_bytes_per_token(args.model),
                             link_gb_per_s=args.link_gb_per_s,
                             decode_kv_tokens=args.decode_kv_tokens)
    return model.fit_handoff(points["handoff"]).fit_gateway_hop(points["prefill"],
                                                                points["prefill_direct"])


async def recalibrate(session, prefill: ServeProcess, url: str, args) -> dict[str, list[dict]]:
    """After the replay, the prompts (straight at the prefill instance and through the
    gateway) and ``--decode-rounds-after`` rounds of decode steps timed again, as before
    it. On a shared host the replay ran 1.19-1.38x slower than the calibration before it
    at every prompt length in one run (74e9555) and its decode steps 15% faster or 22%
    slower than the fitted ones in others (0f6f674): the host drifts over minutes, and the
    points after show how far (a model fitted to both sides was no closer, ``run``)."""
    rng = np.random.default_rng(args.seed + 5)
    direct, _ = await measure_prefill(session, prefill.url + "/v1/completions", args, rng)
    decode, _ = await measure_decode_rounds(session, url, args, rng,
                                            interpolated_seconds(direct),
                                            args.decode_rounds_after)
    handoff = await measure_handoff(session, url, args, rng)
    return {"prefill": handoff["ttft_points"], "prefill_direct": direct, "decode": decode}


def bracketed(before: dict[str, list[dict]], after: dict[str, list[dict]]
              ) -> dict[str, list[dict]]:
    """Service points from both sides of the replay: each prompt length's samples pooled
    (their median its time), each decode point's rounds pooled (their median its step, its
    context the mean); the handoff as timed before."""
    pooled = dict(before)
    for kind in ("prefill", "prefill_direct"):
        pooled[kind] = [{"tokens": b["tokens"], "seconds": float(np.median(samples)),
                         "samples_s": samples}
                        for b, a in zip(before[kind], after[kind], strict=True)
                        if (samples := b["samples_s"] + a["samples_s"])]
    pooled["decode"] = [{**b, "step_ms": float(np.median(steps)), "round_step_ms": steps,
                         "context": round((b["context"] + a["context"]) / 2),
                         "streams": b["streams"] + a["streams"]}
                        for b, a in zip(before["decode"], after["decode"], strict=True)
                        if (steps := b["round_step_ms"] + a["round_step_ms"])]
    return pooled


def drift(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict[str, float]:
    """Per kind, the median over its points of after-the-replay over before."""
    keys = {"prefill": "seconds", "prefill_direct": "seconds", "decode": "step_ms"}
    return {kind: float(np.median([a[key] / b[key] for b, a in
                                   zip(before[kind], after[kind], strict=True)]))
            for kind, key in keys.items()}


def noise(ratios: dict[str, list[float]], args, hold: float = 0.0,
          seed: int | None = None) -> ServiceNoise:
    """The measured spread, drawn afresh from the seed (each simulation its own). A decode
    ratio is the mean of ``STEP_WINDOW`` steps (``measure_decode``), so each holds as many;
    and the next block keeps it with probability ``hold`` (slow stretches that outlast a
    block: ``held_stretches``)."""
    return ServiceNoise(ratios["prefill"], ratios["decode_step"],
                        seed=args.seed if seed is None else seed,
                        steps_per_ratio=STEP_WINDOW, hold_probability=hold)


def replay_host_speed(host_meter: dict | None) -> dict[str, float] | None:
    """How long the host meter's core work took on each instance's core through the
    replay over through calibration (medians; None without a meter): the host's own
    speed, timed apart from the instances, by which ``LatencyModel.at_speed`` runs the
    model at the replay's speed."""
    phases = (host_meter or {}).get("over_calibration") or {}
    if not all("replay" in phases.get(role, {}) for role in ("prefill", "decode")):
        return None
    return {role: phases[role]["replay"]["p50"] for role in ("prefill", "decode")}


def replay_decode_engine_speed(steps: dict | None, model: LatencyModel) -> float | None:
    """The decode engine's own decode-only steps through the replay over the model's step
    for their batch and context, median (None where the run recorded no steps): how much
    slower or faster the decode instance ran than its calibration said. The host meter
    missed such shifts (a decode instance at 1.61x its model while the meter on its core
    read 1.02x), so this reading comes from the instance itself, and what it gives is
    in-sample: with it the simulation checks the group's composition (queueing, batching,
    hand-offs), not the calibration's prediction."""
    if not steps or "decode" not in steps:
        return None
    over = decode_steps_over_model(steps, model)
    return over.get("p50")


def held_stretches(probe: dict) -> float:
    """How often a block of steps keeps the previous block's ratio: the correlation of
    consecutive ``STEP_WINDOW``-step means of the probe's alone answers (the longest
    streams of the calibration, through the gateway as the replay's), none where they
    do not correlate or no figure came."""
    correlation = probe["alone_step_lag_correlation"][f"{STEP_WINDOW}_steps"]
    return min(max(correlation or 0.0, 0.0), 0.99)


def spread(ratios: list[float]) -> dict:
    """Measured times over their point's median: what the simulator draws from."""
    return {"samples": len(ratios), **{f"p{q}": float(np.percentile(ratios, q))
                                       for q in (1, 50, 90, 99)}}


def compare(measured: list[dict], simulated: dict[str, list[dict]]) -> dict:
    """Per metric: measured and each simulation's P50 / P99, and the simulation's error."""
    return compare_percentiles({key: percentiles(measured, key) for key in ("ttft_s", "tpot_s")},
                               simulated)


def compare_percentiles(measured: dict[str, dict], simulated: dict[str, list[dict]]) -> dict:
    """``compare`` against measured P50 / P99 per metric (a recorded run's, say)."""
    table = {}
    for key in ("ttft_s", "tpot_s"):
        row = {"measured": measured[key]}
        for name, rows in simulated.items():
            row[name] = percentiles(rows, key)
            row[name + "_error"] = {q: row[name][q] / row["measured"][q] - 1
                                    for q in ("p50", "p99")}
        table[key] = row
    return table


def _run_name(path: str) -> str:
    """A run's file name without .json or .json.gz: its key among the summarised runs."""
    return Path(path).name.removesuffix(".gz").removesuffix(".json")


def summarize_runs(paths: list[str]) -> dict:
    """Several runs' results side by side, and per metric, simulation and percentile the
    spread of the simulation's error over the runs (smallest, largest)."""
    runs = {}
    for path in paths:
        run, name = load_json(path), _run_name(path)
        runs[name] = {key: run[key] for key in (
            "git_revision", "created", "host_load_average_1min", "host_cpu", "shared_cores",
            "compare") if key in run}
        if run.get("recalibration"):
            runs[name]["drift_after_replay"] = run["recalibration"]["drift"]
    spread: dict[str, dict] = {}
    for key in ("ttft_s", "tpot_s"):
        # a simulation some runs lack (added since) spans the runs that have it
        sides = dict.fromkeys(k[:-len("_error")] for r in runs.values()
                              for k in r["compare"][key] if k.endswith("_error"))
        spread[key] = {side: {q: [min(e), max(e)] for q in ("p50", "p99") if (e := [
            r["compare"][key][side + "_error"][q] for r in runs.values()
            if side + "_error" in r["compare"][key]])} for side in sides}
    return {"kind": "validation", "runs": runs, "error_spread": spread}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def write_or_print(report: dict, out: str | None) -> None:
    """To ``--out`` where given, else to stdout (a summary read on the spot)."""
    if out:
        write_json(report, out)
    else:
        print(json.dumps(report, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--serve-args", default="--dtype float32 --device cpu")
    parser.add_argument("--prompt-lens", type=ints, default=[64, 256, 512, 1024])
    parser.add_argument("--decode-batches", type=ints, default=[1, 2, 4],
                        help="Where the replay runs: a line fitted through larger batches "
                        "overstated the small ones.")
    parser.add_argument("--decode-contexts", type=ints, default=[64, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-rounds", type=int, default=15,
                        help="Rounds of one prompt per length through the gateway: the "
                        "prompts' fitted times and spread, in 5 groups spread over the "
                        "calibration (PromptRounds; after the replay, back to back).")
    parser.add_argument("--decode-rounds", type=int, default=3,
                        help="Times each decode point is timed, in rounds over all points "
                        "(its step: the median of its rounds').")
    parser.add_argument("--warmup-s", type=float, default=10.0,
                        help="Untimed prompts through the gateway before the calibration "
                        "(warm_group): a fresh group's first seconds ran 2x slow.")
    parser.add_argument("--decode-warmup-rounds", type=int, default=1,
                        help="Untimed rounds over every decode point before the timed "
                        "ones: the first streams of a fresh decode instance ran 2-3.5x "
                        "slower for seconds (four runs of five on a 16-core host), and "
                        "their ratios read as the host's slow stretches.")
    parser.add_argument("--decode-rounds-after", type=int, default=1,
                        help="Rounds of decode steps timed again after the replay, with "
                        "the prompts both ways: the drift, and a model fitted to both "
                        "sides simulated beside (0: none).")
    parser.add_argument("--step-floor-ms", type=float, default=1.0,
                        help="No decode step is faster (bounds how long a batch's prompts, "
                        "prefilled one after another, keep it from decoding together).")
    parser.add_argument("--decode-steps", type=int, default=128,
                        help="Tokens per calibration stream (the first and last 8 untimed).")
    parser.add_argument("--sharing-cycles", type=int, default=3,
                        help="Rounds alone, beside, beside, alone of the shared-cores probe.")
    parser.add_argument("--idle-pauses-s", type=rising_seconds, default=[0.5, 2.0],
                        help="Pauses of the idle probe: how much longer a prompt takes "
                        "after the group idled that long (the replay's requests come "
                        "after idle cores, the calibration's back to back).")
    parser.add_argument("--host-meter-period-s", type=float, default=0.5,
                        help="time a fixed CPU workload (benchmarks/host_meter.py) on each "
                        "instance's core this often, for the host's speed apart from the "
                        "instances (0: off)")
    parser.add_argument("--pin-cores", action=argparse.BooleanOptionalAction, default=True,
                        help="The prefill instance on the first core, the decode instance "
                        "on the second (the gateway and the client: --client-core): the two never "
                        "take each other's core.")
    parser.add_argument("--client-core", choices=("any", "prefill", "rest"), default="any",
                        help="With --pin-cores: where the gateway and the client (this "
                        "process) run: any core; the prefill instance's only, which "
                        "leaves the decode instance's core to it alone; or every core "
                        "but the instances' (three or more cores), where no instance "
                        "shares its core with anything but its host meter.")
    parser.add_argument("--draws", type=int, default=10,
                        help="Draws of the measured spread per simulation: each draw's "
                        "percentiles, their median (the pooled rows' beside).")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rate", type=float, default=0.5, help="Requests a second.")
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--ttft-slo-s", type=float, default=2.0)
    parser.add_argument("--max-wait-s", type=float, default=30.0)
    parser.add_argument("--link-gb-per-s", type=float, default=1.5,
                        help="KV link speed (1.5: kv_transfer_cpu.json's loopback result).")
    parser.add_argument("--decode-kv-tokens", type=int, default=100_000)
    parser.add_argument("--keep-heap", action=argparse.BooleanOptionalAction, default=True,
                        help="Run the instances with glibc's heap kept (KEEP_HEAP_ENV: freed "
                        "blocks stay in the process instead of going back to the OS).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--summarize", nargs="+", metavar="RESULT",
                        help="Write runs' results side by side to --out instead of a run.")
    parser.add_argument("--resimulate", metavar="RESULT",
                        help="Simulate a recorded run again with today's simulator (its "
                        "recorded model, factors, spread and requests) and write the "
                        "comparison to --out instead of a run.")
    parser.add_argument("--refit", action="store_true",
                        help="With --resimulate, fit the model (and the both-sides one) "
                        "again from the run's recorded service points by today's fit, "
                        "instead of taking the model the run recorded.")
    parser.add_argument("--skip-prompt-rounds", type=int, default=0, metavar="K",
                        help="With --resimulate, leave out the run's first K rounds of "
                        "prompts through the gateway (their medians and spread; with "
                        "--refit the model too): what a warm-up would have changed.")
    parser.add_argument("--assume-prefill-steps", type=assumed_steps, metavar="CHUNK[,late]",
                        help="With --resimulate, for a run that did not record them: the "
                        "prefill instance's chunk budget, and 'late' where its tokens came "
                        "back one step late (overlap scheduling on a CPU).")
    args = parser.parse_args()
    if args.resimulate:
        write_or_print({**result_header({"resimulate": args.resimulate}),
                        **resimulate(args.resimulate, args, args.assume_prefill_steps)},
                       args.out)
        return 0
    if args.summarize:
        write_or_print({**result_header({"summarize": args.summarize}),
                        **summarize_runs(args.summarize)}, args.out)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # instances: one core each, not all
    if args.keep_heap:
        for name, value in KEEP_HEAP_ENV.items():
            os.environ.setdefault(name, value)
    # what the instances inherit, as they ran (a setting made outside this script included)
    instance_environment = {name: os.environ.get(name)
                            for name in ("OMP_NUM_THREADS", *KEEP_HEAP_ENV)}
    result = asyncio.run(run(args))
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = {**result_header(config), "kind": "validation",
              "instance_environment": instance_environment, **result}
    for key, sides in report["compare"].items():
        print(key, sides)
    if args.out:
        write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
