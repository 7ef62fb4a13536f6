"""Mixed steps with and without a chunk floor, and the other rules they were weighed
against (offline, no GPU).

A closed-loop replay of the multiplexing planner's mixed steps: the measured timelines give
each kind of mixed step (eager or on the prefill-step graphs, by chunk size) its measured
device time over the profile's prediction; the probe's prompts are then walked one after
another beside a constant decode batch, the real ``MuxPlanner`` choosing every chunk, each
step taking the profile's time times its kind's measured factor, and an
``OnlineCalibration`` learning from those times as the engine's does. Variants: the
planner as it is, with ``mixed_floor_tokens`` (``--mux-mixed-floor-tokens``), with small
chunks learning factors of their own (an idea this replay rejected), each without and with
graph steps; and chunked prefill's rule (256 tokens a step, decodes included) at the same
costs. It shows what the planner's choice and the learned factors do with the measured
costs (``"kind": "offline replay"``), mixed steps only (no spatial split or time slice);
it is not a GPU result.

    python benchmarks/mux_mixed_floor_replay.py \\
        --predictor benchmarks/results/loogle_h200/d698fcb_predictor.json \\
        --timelines <multiplex *_timeline.json.gz, comma-separated> \\
        --record benchmarks/results/goodput_h200/mooncake__multiplex-temporal-itl60__r0.5.json \\
        --out benchmarks/results/mux_mixed_floor_replay_<rev>.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mux_whatif import WAITED_MS, comma_paths, load_timeline  # noqa: E402

from pdserve.bench.report import write_json  # noqa: E402
from pdserve.sched.mux_planner import (  # noqa: E402
    DecodeLoad,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
)
from pdserve.sched.predictor import LatencyPredictor  # noqa: E402

BUCKET = 64  # chunk sizes are multiples of the planner's token alignment
LARGEST_BUCKET = 384  # few steps above it in any run: they share its factor
GRAPH_STEP_TOKENS = 256  # the probes' --mux-graph-step-tokens


def kind_of(prefill_tokens: int, decode_batch: int) -> tuple[bool, int]:
    """(on the graphs, chunk size bucket) of a mixed step."""
    graph = prefill_tokens + decode_batch <= GRAPH_STEP_TOKENS
    return graph, max(BUCKET, min(prefill_tokens // BUCKET * BUCKET, LARGEST_BUCKET))


def measured_factors(timelines: list[list[dict]], graph_steps: list[bool]) -> dict:
    """Median device time over the profile's prediction of each kind of mixed step.

    An eager step's prediction over the timeline's ``calibration`` (the eager factor) is the
    profile's; a graph step's factor is not in the timeline, so it is replayed from the
    run's own steps (``OnlineCalibration``'s rule, from 1.0). ``graph_steps``: whether each
    run weighed graph steps (its --mux-graph-step-tokens)."""
    ratios: dict[tuple[bool, int], list[float]] = defaultdict(list)
    for entries, weighed in zip(timelines, graph_steps, strict=True):
        replay = OnlineCalibration.learning_only()
        for e in entries:
            if e["mode"] != "temporal" or e["measured_device_ms"] <= 0:
                continue
            graph, bucket = kind_of(e["prefill_tokens"], e["decode_batch"])
            graph = graph and weighed
            factor = replay.graph_mixed_correction if graph else e["calibration"]
            ratios[graph, bucket].append(e["measured_device_ms"] * factor / e["predicted_cycle_ms"])
            if graph:
                replay.observe_mixed(e["predicted_cycle_ms"], e["measured_device_ms"], True)
    return {key: (statistics.median(v), len(v)) for key, v in ratios.items()}


def weighed_graph_steps(timeline: str) -> bool:
    """Whether the run of ``timeline`` (the probe record beside it) weighed graph steps."""
    record = Path(timeline).parent / (Path(timeline).name.split("_timeline.json")[0] + ".json")
    return "--mux-graph-step-tokens" in json.loads(record.read_text())["config"]["server_args"]


def truth_factor(factors: dict, prefill_tokens: int, decode_batch: int) -> float:
    """A step's measured factor: its kind's, else the nearest bucket's of the same kind."""
    graph, bucket = kind_of(prefill_tokens, decode_batch)
    same = [b for g, b in factors if g == graph] or [b for _, b in factors]
    nearest = min(same, key=lambda b: abs(b - bucket))
    return factors.get((graph, nearest), factors.get((not graph, nearest)))[0]


class SmallChunkCalibration(OnlineCalibration):
    """An ``OnlineCalibration`` whose mixed steps of at most ``small_chunk_tokens`` prompt
    tokens learn factors of their own (eager and graph): the idea that small steps' high
    cost should not raise full-size steps' predictions, weighed here offline only."""

    def __init__(self, model, small_chunk_tokens: int):
        super().__init__(model)
        self.small_chunk_tokens = small_chunk_tokens
        self.small = {False: 1.0, True: 1.0}  # by "on the graphs"

    def predict_mixed(self, prefill_tokens: int, *args, **kwargs) -> float:
        return self._scaled(False, prefill_tokens, args, kwargs)

    def predict_graph_mixed(self, prefill_tokens: int, *args, **kwargs) -> float:
        return self._scaled(True, prefill_tokens, args, kwargs)

    def _scaled(self, graph: bool, prefill_tokens: int, args, kwargs) -> float:
        factor = (self.small[graph] if prefill_tokens <= self.small_chunk_tokens else
                  self.graph_mixed_correction if graph else self.mixed_correction)
        return factor * self.model.predict_mixed(prefill_tokens, *args, **kwargs)

    def observe_sized(self, predicted_ms: float, measured_ms: float, graph: bool,
                      prefill_tokens: int) -> None:
        if prefill_tokens <= self.small_chunk_tokens:
            self.small[graph] = self._moved(self.small[graph], predicted_ms, measured_ms)
        else:
            self.observe_mixed(predicted_ms, measured_ms, graph)


@dataclass(frozen=True)
class Variant:
    graph_step_tokens: int = 0
    mixed_floor_tokens: int = 0
    small_chunk_tokens: int = 0  # 0: the engine's one factor per kind
    # Chunked prefill's rule instead of the planner's: this many tokens a step, decodes
    # included, on the graphs (0: the planner chooses).
    chunked_step_tokens: int = 0


def walk(predictor, factors: dict, prompts: list[int], decode: DecodeLoad, itl_ms: float,
         variant: Variant) -> dict:
    """Every prompt's prefill in mixed steps, one prompt after another (the calibration
    carried over), each step taking the profile's time times its measured factor."""
    model = SmallChunkCalibration(predictor, variant.small_chunk_tokens)
    config = MuxPlannerConfig(itl_slo_ms=itl_ms, spatial=False, time_slice=False,
                              graph_step_tokens=variant.graph_step_tokens,
                              mixed_floor_tokens=variant.mixed_floor_tokens)
    planner = MuxPlanner(model, [], config, predictor.total_sms)
    chunks, times = [], []
    for prompt in prompts:
        done = 0
        while done < prompt:
            plan = planner.plan(decode, [PrefillRequest(prompt - done, done, WAITED_MS)])
            chunk = plan.prefill.num_tokens
            if variant.chunked_step_tokens:
                chunk = min(prompt - done, variant.chunked_step_tokens - decode.batch_size)
            raw = predictor.predict_mixed(chunk, done, 1, decode.batch_size,
                                          decode.context_tokens)
            ms = raw * truth_factor(factors, chunk, decode.batch_size)
            model.observe_sized(plan.decode_ms, ms, planner.on_graphs(chunk, decode.batch_size),
                                chunk)
            chunks.append(chunk)
            times.append(ms)
            done += chunk
    return summary(variant, prompts, chunks, times, itl_ms, model)


def summary(variant: Variant, prompts: list[int], chunks: list[int], times: list[float],
            itl_ms: float, model: SmallChunkCalibration) -> dict:
    total = sum(times)
    small = sum(ms for ms, chunk in zip(times, chunks, strict=True) if chunk <= 128)
    return {**asdict(variant), "prefill_tokens_per_s": round(1e3 * sum(prompts) / total),
            "steps": len(chunks), "median_chunk": statistics.median(chunks),
            "share_of_time_in_chunks_up_to_128": round(small / total, 3),
            "mean_step_ms": round(total / len(times), 1),
            "p90_step_ms": round(sorted(times)[9 * len(times) // 10], 1),
            "steps_over_itl": sum(ms > itl_ms for ms in times),
            "learned": {"mixed": round(model.mixed_correction, 3),
                        "graph_mixed": round(model.graph_mixed_correction, 3),
                        "small_eager": round(model.small[False], 3),
                        "small_graph": round(model.small[True], 3)}}


VARIANTS = (*(Variant(graphs, floor, small) for graphs in (0, GRAPH_STEP_TOKENS)
              for floor, small in ((0, 0), (0, 128), (256, 0))),
            Variant(chunked_step_tokens=GRAPH_STEP_TOKENS))


def _line(run: dict) -> str:
    return (f"batch {run['decode_batch']} graphs {run['graph_step_tokens']} floor "
            f"{run['mixed_floor_tokens']} small {run['small_chunk_tokens']} chunked "
            f"{run['chunked_step_tokens']}: {run['prefill_tokens_per_s']} tok/s, mean step "
            f"{run['mean_step_ms']} ms (p90 {run['p90_step_ms']}), "
            f"{run['share_of_time_in_chunks_up_to_128']:.0%} of the time in chunks <= 128")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictor", required=True)
    parser.add_argument("--timelines", required=True, help="comma-separated, each beside "
                        "its probe record (which says whether it weighed graph steps)")
    parser.add_argument("--record", required=True, help="a goodput probe record: its "
                        "prompt lengths, in order, are walked")
    parser.add_argument("--decode-batches", default="3,5,8", help="comma-separated; the "
                        "Mooncake probe's batch was 5-6 at the median, 8 at p90")
    parser.add_argument("--decode-context", type=int, default=11000, help="per request")
    parser.add_argument("--itl-ms", type=float, default=60.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    paths = comma_paths(args.timelines)
    graph_steps = [weighed_graph_steps(p) for p in paths]
    timelines = [load_timeline(p) for p in paths]
    factors = measured_factors(timelines, graph_steps)
    predictor = LatencyPredictor.load(args.predictor)
    prompts = [s["prompt_len"] for s in json.loads(Path(args.record).read_text())["samples"]]
    runs = []
    for batch in (int(b) for b in comma_paths(args.decode_batches)):
        decode = DecodeLoad(batch, batch * args.decode_context)
        for variant in VARIANTS:
            runs.append({"decode_batch": batch,
                         **walk(predictor, factors, prompts, decode, args.itl_ms, variant)})
            print(_line(runs[-1]))
    write_json({
        "kind": "offline replay", "command": shlex.join(["benchmarks/mux_mixed_floor_replay.py",
                                                         *(argv or sys.argv[1:])]),
        "measured_factors": [{"graph": g, "chunk_bucket": b, "device_over_profile": round(f, 3),
                              "steps": n} for (g, b), (f, n) in sorted(factors.items())],
        "prompts": len(prompts),
        "decode_context_per_request": args.decode_context, "itl_ms": args.itl_ms,
        "runs": runs}, args.out)


if __name__ == "__main__":
    main()
