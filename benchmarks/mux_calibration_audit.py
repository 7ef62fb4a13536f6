"""What the multiplexing planner's online corrections learned, against what they should have
(offline, from committed H200 records; no GPU).

Three questions, each answered from measured records with the fitted predictor:

- **Mixed steps by shape** (``--timelines``): every mixed step's measured time over the
  profile's raw prediction (the timeline's prediction over the correction it carried),
  by decode batch, chunk, cached prefix and decode context per request; how much of its
  spread the shape explains (between-bucket over total variance of the log ratio); and
  the learned correction over the run. ``--mixed-bench`` adds the one-off mixed steps
  of ``bench_mixed_step.py``.
- **Prefill corrections** (same timelines, where they record them): each option's
  learned prefill correction against its pieces' measured over predicted time, and which
  update rule the recorded values follow step by step: ``c * r ** w`` (compounding: the
  raw prediction is compared, so a steady ratio of 0.9 walks the factor to its 0.5 bound)
  or ``c ** (1 - w) * r ** w`` (converging on the ratio).
- **Mooncake states** (``--records``): the decode batch and context while each request's
  prompt was prefilled, reconstructed from per-request send time, TTFT, E2E and lengths
  (first come, first served: a prompt's prefill starts at max(its arrival, the previous
  request's first token)); ``mux_whatif.walk_prompt`` walks that prompt beside that load
  at each mixed correction (``--corrections``) and each prefill correction of the split
  options (``--prefill-corrections``), as the probe's planner flags would. For a chunked
  run's records, each request's TPOT against the predictor's steps over its decode span.

    python benchmarks/mux_calibration_audit.py \\
        --predictor benchmarks/results/loogle_h200/d698fcb_predictor.json \\
        --timelines benchmarks/results/loogle_h200/*_timeline.json.gz,... \\
        --records benchmarks/results/goodput_h200/mooncake__chunk256__r0.5.json,... \\
        --out benchmarks/results/mux_calibration_audit_<revision>.json

Every figure is computed from the records named; walks are predictions, the rest are
measurements set against the predictor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mux_whatif import (  # noqa: E402
    comma_paths,
    decode_context,
    load_timeline,
    settings_of,
    walk_prompt,
)

from pdserve.bench.timeline import piece_times, prefill_delivery  # noqa: E402
from pdserve.config import PIECE_RULES  # noqa: E402
from pdserve.sched.mux_planner import DecodeLoad, MuxMode, OnlineCalibration  # noqa: E402
from pdserve.sched.predictor import LatencyPredictor  # noqa: E402
from pdserve.sim.mux_steps import timeline_kind  # noqa: E402

BATCH_EDGES = (1, 4, 8, 16, 32)
CHUNK_EDGES = (128, 256, 512, 1024)
PREFIX_EDGES = (0, 2048, 8192, 16384)
CONTEXT_EDGES = (2048, 4096, 8192, 16384)  # decode context per request
# A prompt whose first token came within this of the one before it was prefilled in the
# same batch: its own window says nothing of its rate (one ITL target of 60 ms).
SAME_BATCH_S = 0.06
SPLIT_OPTIONS = ("spatial", "time_slice")  # the options whose prefill pieces are corrected


def bucket(value: float, edges: tuple[int, ...]) -> str:
    for edge in edges:
        if value <= edge:
            return f"<={edge}"
    return f">{edges[-1]}"


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    rank = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"n": len(ordered), "p10": round(rank(0.1), 3), "p50": round(rank(0.5), 3),
            "p90": round(rank(0.9), 3)}


# ------------------------------------------------------------ mixed steps by shape

def mixed_steps(entries: list[dict], predictor) -> list[dict]:
    """Each mixed step with a measured time: its shape and measured over raw prediction
    (the device's clock where the timeline has it, as the engine learns from).

    A step predicted on the prefill-step graphs carried the graph correction, which the
    timeline does not record: those runs (``--mux-graph-step-tokens``) are not read here."""
    steps = []
    for entry in entries:
        measured = entry.get("measured_device_ms") or entry["measured_cycle_ms"]
        if entry["mode"] != "temporal" or measured <= 0 or not entry["prefill_tokens"]:
            continue
        raw = entry["predicted_decode_ms"] / entry["calibration"]
        context = decode_context(entry, predictor)
        steps.append({"time": entry["time"], "batch": entry["decode_batch"],
                      "chunk": entry["prefill_tokens"],
                      "prefix": entry["prefill_context_tokens"],
                      "context_per_request": (context or 0.0) / entry["decode_batch"],
                      "ratio": measured / raw, "correction": entry["calibration"]})
    return steps


SHAPES = {"batch": BATCH_EDGES, "chunk": CHUNK_EDGES, "prefix": PREFIX_EDGES,
          "context_per_request": CONTEXT_EDGES}


def by_shape(steps: list[dict]) -> dict:
    """Measured over predicted quantiles per bucket of each shape dimension."""
    table = {}
    for name, edges in SHAPES.items():
        groups: dict[str, list[float]] = {}
        for step in steps:
            groups.setdefault(bucket(step[name], edges), []).append(step["ratio"])
        table[name] = {key: quantiles(ratios) for key, ratios in sorted(groups.items())}
    return table


def shape_share(steps: list[dict]) -> float:
    """Share of the log ratio's variance between joint shape buckets (batch x chunk x
    prefix x context): near 0, a step's error is noise around one factor; near 1, the
    shape decides it and one scalar cannot fit every shape."""
    logs = [math.log(s["ratio"]) for s in steps]
    mean = statistics.fmean(logs)
    total = sum((x - mean) ** 2 for x in logs)
    groups: dict[tuple, list[float]] = {}
    for step, x in zip(steps, logs, strict=True):
        key = tuple(bucket(step[name], edges) for name, edges in SHAPES.items())
        groups.setdefault(key, []).append(x)
    between = sum(len(g) * (statistics.fmean(g) - mean) ** 2 for g in groups.values())
    return round(between / total, 3) if total > 0 else 0.0


def correction_path(steps: list[dict], high: float = 1.15) -> dict:
    """The learned mixed correction over the run, the share of mixed steps planned with it
    at ``high`` or above, and the shapes of the five steps before each first crossing."""
    values = [s["correction"] for s in steps]
    crossings = [i for i in range(1, len(values)) if values[i] >= high > values[i - 1]]
    drivers = [{k: round(s[k], 3) for k in ("batch", "chunk", "prefix", "ratio")}
               for i in crossings[:3] for s in steps[max(0, i - 5):i]]
    return {**quantiles(values), "min": round(min(values), 3), "max": round(max(values), 3),
            f"share_at_or_above_{high}": round(sum(v >= high for v in values) / len(values), 3),
            "crossings": len(crossings), "steps_before_first_crossings": drivers}


def mixed_bench(path: str, predictor) -> list[dict]:
    """``bench_mixed_step.py``'s cases (decode context per request) against the profile."""
    cases = json.loads(Path(path).read_text())["cases"]
    rows = []
    for case in cases:
        batch = case["decodes"]
        predicted = predictor.predict_mixed(case["prefill_tokens"], case["prefix"], 1, batch,
                                            batch * case["decode_context"])
        row = {k: case[k] for k in ("prefill_tokens", "prefix", "decodes", "decode_context")}
        row["eager_over_predicted"] = round(case["eager_ms"] / predicted, 3)
        if "piecewise_ms" in case:
            row["piecewise_over_predicted"] = round(case["piecewise_ms"] / predicted, 3)
        rows.append(row)
    return rows


# ----------------------------------------------------- prefill corrections' update rule

def prefill_corrections(entries: list[dict], weight: float = 0.2) -> dict:
    """Per split option: its recorded prefill correction (first, range, last), its
    pieces' measured over predicted time, and how many of the recorded steps between
    consecutive launched pieces follow each update rule (see the module's docstring)."""
    options: dict[str, list[dict]] = {}
    for entry in entries:
        if entry["mode"] in SPLIT_OPTIONS and "prefill_calibration" in entry:
            key = entry["mode"] + (f":{entry['decode_sms']}" if entry["mode"] == "spatial"
                                   else "")
            options.setdefault(key, []).append(entry)
    return {key: _option_audit(rows, weight) for key, rows in sorted(options.items())}


def _option_audit(entries: list[dict], weight: float) -> dict:
    values = [e["prefill_calibration"] for e in entries]
    pieces = [e for e in entries if e["piece_launched"] and e["measured_piece_ms"] > 0
              and e["predicted_piece_ms"] > 0]
    ratios = [e["measured_piece_ms"] / e["predicted_piece_ms"] for e in pieces]
    return {"decisions": len(entries), "first": round(values[0], 3),
            "min": round(min(values), 3), "max": round(max(values), 3),
            "last": round(values[-1], 3),
            "piece_measured_over_predicted": quantiles(ratios) if ratios else None,
            "update_rule": _update_rule(entries, weight),
            "rules_replayed": replay_rules([(e["predicted_piece_ms"], e["measured_piece_ms"])
                                            for e in pieces], values[0])}


def replay_rules(pieces: list[tuple[float, float]], start: float) -> dict:
    """The engine's own correction (``OnlineCalibration.observe_prefill``) under each update
    rule, run over an option's pieces as they came (``pieces``: the profile's predicted and
    the measured ms), from the factor the run started with: each piece's measured time over
    the corrected prediction it was weighed by (> 1: the planner expected more prefill than
    the piece gave) and where the factor ended. The pieces are the ones the recorded rule's
    choices launched."""
    out = {}
    for rule in PIECE_RULES:
        calibration = OnlineCalibration.learning_only(prefill_rule=rule)
        calibration.prefill_corrections["option"] = start
        met = []
        for predicted, measured in pieces:
            met.append(measured / (predicted * calibration.prefill_correction("option")))
            calibration.observe_prefill("option", predicted, measured)
        out[rule] = {"measured_over_corrected": quantiles(met) if met else None,
                     "pieces_10pct_off": sum(abs(math.log(m)) > math.log(1.1) for m in met),
                     "last": round(calibration.prefill_correction("option"), 3)}
    return out


def _update_rule(entries: list[dict], weight: float, step_limit: float = 1.25) -> dict:
    """Consecutive launched pieces whose recorded correction moved, matched against each
    rule's next value (where the two rules tell apart: a factor near 1.0 moves alike)."""
    compounding = converging = checked = 0
    launched = [e for e in entries if e["piece_launched"] and e["measured_piece_ms"] > 0]
    for before, after in zip(launched, launched[1:], strict=False):
        c, c_next = before["prefill_calibration"], after["prefill_calibration"]
        ratio = before["measured_piece_ms"] / before["predicted_piece_ms"]
        ratio = min(max(ratio, 1 / step_limit), step_limit)
        by_compounding = c * ratio ** weight
        by_converging = c ** (1 - weight) * ratio ** weight
        if c_next == c or min(c, c_next) <= 0.5 or max(c, c_next) >= 2.0 \
                or math.isclose(by_compounding, by_converging, rel_tol=2e-3):
            continue  # nothing learned in between, held at a bound, or both rules agree
        checked += 1
        compounding += math.isclose(c_next, by_compounding, rel_tol=2e-3)
        converging += math.isclose(c_next, by_converging, rel_tol=2e-3)
    return {"steps_checked": checked, "match_compounding": compounding,
            "match_converging": converging}


# ------------------------------------------------------------------ Mooncake states

@dataclass(frozen=True)
class Span:
    """One request as its record saw it (seconds from the run's start)."""

    arrival: float
    first_token: float
    end: float
    prompt: int
    output: int

    def context_at(self, t: float) -> float:
        """Tokens in its KV cache at ``t`` while it decodes."""
        share = (t - self.first_token) / (self.end - self.first_token)
        return self.prompt + self.output * min(max(share, 0.0), 1.0)


def spans_of(record: dict) -> list[Span]:
    samples = [s for s in record["samples"] if s["success"]]
    spans = [Span(s["send_s"], s["send_s"] + s["ttft_ms"] / 1e3, s["send_s"] + s["e2e_ms"] / 1e3,
                  s["prompt_len"], s["output_tokens"]) for s in samples]
    return sorted(spans, key=lambda s: s.arrival)


def decode_load_at(spans: list[Span], t: float) -> DecodeLoad:
    decoding = [s for s in spans if s.first_token <= t < s.end]
    return DecodeLoad(len(decoding), int(sum(s.context_at(t) for s in decoding)))


def prefill_windows(spans: list[Span]) -> list[tuple[Span, float]]:
    """(request, when its prefill started): first come, first served."""
    windows, previous = [], 0.0
    for span in spans:
        start = max(span.arrival, previous)
        windows.append((span, start))
        previous = max(previous, span.first_token)
    return windows


def decode_states(spans: list[Span]) -> list[dict]:
    """Each prompt's prefill: the decode load half-way through it (the batch grows and
    shrinks meanwhile; one load stands for the window) and its measured rate."""
    states = []
    for span, start in prefill_windows(spans):
        load = decode_load_at(spans, (start + span.first_token) / 2)
        seconds = span.first_token - start
        states.append({"start_s": round(start, 3), "prompt": span.prompt,
                       "decode_batch": load.batch_size,
                       "decode_context_per_request": round(
                           load.context_tokens / max(load.batch_size, 1)),
                       "measured_tokens_per_s": round(span.prompt / seconds)
                       if seconds > SAME_BATCH_S else None, "seconds": seconds, "load": load})
    return states


def walk_states(states: list[dict], predictor, settings, graph_tokens: int,
                mixed: float, prefill: float, mixed_floor: int = 0) -> dict:
    """Every state beside decode walked at one mixed and one split prefill correction:
    decisions by mode, the prefill rate the planner expects (its corrections taken as
    true) and the rate its choices get where steps and pieces take what the profile
    predicts (``at_profile_ms``): the measured medians of both sides are within a few
    percent of the profile (``timelines`` of this analysis). ``mixed_floor``: the planner's
    ``mixed_floor_tokens`` (``--mux-mixed-floor-tokens``)."""
    planner_settings = replace(settings, mixed_correction=mixed, prefill_corrections={
        **{f"spatial:{d}": prefill for d in (16, 24, 32, 48, 64)}, "time_slice": prefill})
    modes: dict[str, int] = {}
    tokens, expected_s, profile_s = 0.0, 0.0, 0.0
    for state in states:
        planner = planner_settings.planner(predictor)
        planner.predictor.graph_mixed_correction = mixed
        planner.config = replace(planner.config, graph_step_tokens=graph_tokens,
                                 mixed_floor_tokens=mixed_floor)
        expected = walk_prompt(planner, state["prompt"], state["load"])
        at_profile = walk_prompt(planner, state["prompt"], state["load"],
                                 plan_ms=lambda plan: at_profile_ms(plan, mixed))
        for mode, count in expected["decisions_by_mode"].items():
            modes[mode] = modes.get(mode, 0) + count
        tokens += state["prompt"]
        expected_s += state["prompt"] / expected["prefill_tokens_per_s"]
        profile_s += state["prompt"] / at_profile["prefill_tokens_per_s"]
    return {"mixed_correction": mixed, "split_prefill_correction": prefill,
            "mixed_floor_tokens": mixed_floor, "decisions_by_mode": modes,
            "expected_tokens_per_s": round(tokens / expected_s) if expected_s else None,
            "at_profile_tokens_per_s": round(tokens / profile_s) if profile_s else None}


def at_profile_ms(plan, mixed: float) -> float:
    """How long ``plan`` takes if it runs as the profile predicts: no learned correction
    (a mixed step's prediction carries ``mixed``; a piece's none)."""
    if plan.mode == MuxMode.TEMPORAL:
        return plan.cycle_ms / mixed
    if plan.mode == MuxMode.SPATIAL:
        return max(plan.cycle_ms, plan.prefill.predicted_ms)
    return plan.cycle_ms


def chunked_rate(states: list[dict], predictor, chunk: int) -> int:
    """The predictor's prefill rate over these states for chunked prefill: each prompt in
    steps of ``chunk`` tokens, its decode batch included, with no online correction."""
    tokens = ms = 0.0
    for state in states:
        load, done = state["load"], 0
        while done < state["prompt"]:
            take = min(max(chunk - load.batch_size, 1), state["prompt"] - done)
            ms += predictor.predict_mixed(take, done, 1, load.batch_size, load.context_tokens)
            done += take
        tokens += state["prompt"]
    return round(1e3 * tokens / ms)


def chunked_tpot(spans: list[Span], predictor, chunk: int) -> dict:
    """Each request's measured TPOT against the predictor's steps over its decode span:
    a mixed step of ``chunk`` tokens (decodes included, as ``--chunk-size`` counts them)
    while some prompt is prefilling (its prefix growing evenly over its window), a
    decode step otherwise."""
    windows = prefill_windows(spans)
    errors = []
    for span in spans:
        if span.output < 2:
            continue
        t, steps = span.first_token, 0
        while t < span.end:
            t += _chunked_step_ms(spans, windows, t, predictor, chunk) / 1e3
            steps += 1
        measured = (span.end - span.first_token) / (span.output - 1)
        predicted = (span.end - span.first_token) / steps
        errors.append(measured / predicted)
    return {"requests": len(errors), "measured_over_predicted_tpot": quantiles(errors)}


def _chunked_step_ms(spans, windows, t: float, predictor, chunk: int) -> float:
    load = decode_load_at(spans, t)
    sms = predictor.total_sms
    for span, start in windows:
        if start <= t < span.first_token:
            prefix = int(span.prompt * (t - start) / (span.first_token - start))
            tokens = max(chunk - load.batch_size, 1)
            return predictor.predict_mixed(tokens, prefix, 1, load.batch_size,
                                           load.context_tokens)
    return predictor.predict("decode", load.batch_size, load.context_tokens,
                             load.batch_size, sms)


# ----------------------------------------------------------------------------- main

def audit_timeline(path: str, predictor) -> dict:
    entries = load_timeline(path)
    steps = mixed_steps(entries, predictor)
    row: dict = {"mixed_steps": len(steps)}
    if steps:
        row.update(measured_over_predicted=quantiles([s["ratio"] for s in steps]),
                   by_shape=by_shape(steps), shape_share_of_variance=shape_share(steps),
                   correction=correction_path(steps))
    row["prefill_corrections"] = prefill_corrections(entries)
    return row


def audit_records(path: str, predictor, mixed: list[float], prefill: list[float],
                  floors: tuple[int, ...] = (0,)) -> dict:
    record = json.loads(Path(path).read_text())
    spans = spans_of(record)
    args = record["config"]["server_args"]
    row: dict = {"server_args": args, "slo_attainment": record["summary"]["slo_attainment"]}
    states = decode_states(spans)
    beside = [s for s in states if s["load"].batch_size > 0]
    row["states_beside_decode"] = len(beside)
    row["decode_batch"] = quantiles([s["decode_batch"] for s in beside])
    row["decode_context_per_request"] = quantiles(
        [s["decode_context_per_request"] for s in beside])
    rates = [s["measured_tokens_per_s"] for s in beside if s["measured_tokens_per_s"]]
    row["measured_tokens_per_s_beside_decode"] = quantiles(rates)
    row["measured_tokens_per_s_beside_decode_all"] = round(
        sum(s["prompt"] for s in beside) / sum(s["seconds"] for s in beside))
    row["chunk256_predicted_tokens_per_s"] = chunked_rate(beside, predictor, 256)
    if "--chunk-size" in args:
        chunk = int(args.split("--chunk-size")[1].split()[0])
        row["tpot_check"] = chunked_tpot(spans, predictor, chunk)
    settings = settings_of(args.replace("{predictor}", "x"))
    graph = int(args.split("--mux-graph-step-tokens")[1].split()[0]) \
        if "--mux-graph-step-tokens" in args else 0
    if "--schedule multiplex" not in args:  # walk as the multiplex-graph probe plans
        settings, graph = replace(settings, itl_ms=60.0, max_prefill_tokens=24576), 256
    row["walks"] = [walk_states(beside, predictor, settings, graph, m, p, floor)
                    for floor in floors for m in mixed for p in prefill]
    return row


def stall_census(entries: list[dict], ratio: float) -> dict:
    """How a run's mixed steps (device time) and co-running prefill pieces (host time, the
    option's correction in force included) compare with what the plan predicted for them:
    how many took over ``ratio`` times it (``--mux-stall-ratio``'s stalls, each listed with
    its time into the run) and how many 1.5x to ``ratio``x (rates a guard must still learn)."""
    start = entries[0]["time"] if entries else 0.0
    out = {kind: {"observed": 0, "between_1.5x_and_ratio": 0, "stalls": []}
           for kind in ("mixed", "piece")}
    for entry in entries:
        observed = _observed_ratio(entry)
        if observed is None:
            continue
        kind, measured_over_predicted = observed
        row = out[kind]
        row["observed"] += 1
        if measured_over_predicted > ratio:
            row["stalls"].append({"t_s": round(entry["time"] - start, 2),
                                  "ratio": round(measured_over_predicted, 1)})
        elif measured_over_predicted > 1.5:
            row["between_1.5x_and_ratio"] += 1
    return out


def delivery_census(entries: list[dict]) -> dict:
    """Per option of a run: its pieces' measured over predicted time and the prompt tokens
    its batches delivered per second against the rate they were committed by (uncorrected):
    where an option's pieces run as predicted but its batches deliver less, the gap lies
    between the pieces, which no piece correction sees."""
    pieces = piece_times(entries)
    return {option: {"delivery": delivery, "pieces": pieces.get(option)}
            for option, delivery in prefill_delivery(entries).items()}


def _observed_ratio(entry: dict) -> tuple[str, float] | None:
    """(what the engine's calibration learns it as, measured over predicted) of a timeline
    entry; None where it teaches no correction."""
    if entry["mode"] == "temporal" and entry["predicted_cycle_ms"] > 0 \
            and entry.get("measured_device_ms", 0) > 0:
        return "mixed", entry["measured_device_ms"] / entry["predicted_cycle_ms"]
    predicted = entry.get("predicted_piece_ms", 0) * entry.get("prefill_calibration", 1.0)
    if entry["mode"] != "prefill_only" and predicted > 0 and entry.get("measured_piece_ms", 0) > 0:
        return "piece", entry["measured_piece_ms"] / predicted
    return None


def eager_window_replay(entries: list[dict], start: float, windows: list[int],
                        graph_step_tokens: int, stall_ratio: float = 0.0) -> dict:
    """The eager mixed-step correction over a run's recorded eager steps (device time over
    the profile's prediction, the correction in force divided out), as the engine's
    moving rule (window 0) and each median window (``--mux-correction-window``) would have
    learned it from ``start`` (the engine's after its probes): its largest and last value;
    with a ``stall_ratio`` each also as ``--mux-stall-ratio`` would have guarded it. The
    steps are the ones the recorded run chose."""
    eager = [e for e in entries if timeline_kind(e, graph_step_tokens) == "eager"
             and e["measured_device_ms"] > 0 and e["predicted_cycle_ms"] > 0]
    out = {"eager_steps": len(eager),
           "recorded_last": round(eager[-1]["calibration"], 3) if eager else None}
    for window in windows:
        for guard in sorted({0.0, stall_ratio}):
            calibration = OnlineCalibration.learning_only(window=window, stall_ratio=guard)
            calibration.mixed_correction, values = start, []
            for entry in eager:
                raw = entry["predicted_cycle_ms"] / entry["calibration"]
                calibration.observe_mixed(raw * calibration.mixed_correction,
                                          entry["measured_device_ms"])
                values.append(calibration.mixed_correction)
            label = f"window_{window}" + (f"_stall_{guard:g}" if guard else "")
            out[label] = {"max": round(max(values, default=start), 3),
                          "last": round(values[-1] if values else start, 3)}
    return out


def rules_overall(timelines: dict) -> dict:
    """Per update rule, over every option of every timeline: pieces replayed, and those
    weighed more than 10% off what they delivered."""
    totals = {rule: {"pieces": 0, "pieces_10pct_off": 0} for rule in PIECE_RULES}
    for row in timelines.values():
        for option in row["prefill_corrections"].values():
            for rule, replayed in option["rules_replayed"].items():
                measured = replayed["measured_over_corrected"]
                totals[rule]["pieces"] += measured["n"] if measured else 0
                totals[rule]["pieces_10pct_off"] += replayed["pieces_10pct_off"]
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--predictor", required=True)
    parser.add_argument("--timelines", default="", help="multiplex timelines, comma-separated")
    parser.add_argument("--mixed-bench", help="a bench_mixed_step.py record")
    parser.add_argument("--records", default="", help="goodput probe records, comma-separated")
    parser.add_argument("--corrections", default="1.0,1.1,1.2,1.3")
    parser.add_argument("--prefill-corrections", default="1.0,0.75,0.5",
                        help="the split options' learned prefill correction in the walks")
    parser.add_argument("--mixed-floors", default="0", help="the planner's mixed-step floors "
                        "(--mux-mixed-floor-tokens) to walk, comma-separated")
    parser.add_argument("--eager-windows", default="", help="with --eager-start: replay "
                        "each timeline's eager mixed steps through these correction windows "
                        "(0: the moving rule), comma-separated")
    parser.add_argument("--eager-start", type=float, default=1.0,
                        help="the eager correction the engine started the timeline with")
    parser.add_argument("--stall-ratio", type=float, default=0.0,
                        help="count each timeline's observations over this many times their "
                        "prediction (--mux-stall-ratio), and replay the eager windows guarded")
    parser.add_argument("--delivery", action="store_true",
                        help="each timeline's delivery census: pieces against batches")
    parser.add_argument("--graph-step-tokens", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    predictor = LatencyPredictor.load(args.predictor)
    floats = lambda text: [float(x) for x in text.split(",")]
    result = {"kind": "analysis", "command": " ".join(["python", *sys.argv]),
              "git_revision": os.environ.get("PDSERVE_GIT_REVISION", "unknown"),
              "predictor": args.predictor,
              "timelines": {p: audit_timeline(p, predictor) for p in comma_paths(args.timelines)},
              "records": {p: audit_records(p, predictor, floats(args.corrections),
                                           floats(args.prefill_corrections),
                                           tuple(int(x) for x in floats(args.mixed_floors)))
                          for p in comma_paths(args.records)}}
    result["prefill_rules_overall"] = rules_overall(result["timelines"])
    if args.eager_windows:
        windows = [int(x) for x in args.eager_windows.split(",")]
        result["eager_window_replay"] = {
            p: eager_window_replay(load_timeline(p), args.eager_start, windows,
                                   args.graph_step_tokens, args.stall_ratio)
            for p in comma_paths(args.timelines)}
    if args.delivery:
        result["delivery_census"] = {p: delivery_census(load_timeline(p))
                                     for p in comma_paths(args.timelines)}
    if args.stall_ratio:
        result["stall_census"] = {p: stall_census(load_timeline(p), args.stall_ratio)
                                  for p in comma_paths(args.timelines)}
    if args.mixed_bench:
        result["mixed_bench"] = {"path": args.mixed_bench,
                                 "cases": mixed_bench(args.mixed_bench, predictor)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1)[:20000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
