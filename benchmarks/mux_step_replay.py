"""Multiplexing's whole-GPU steps replayed on a recorded probe's requests, step by step, with
the real ``MuxPlanner`` choosing every step and the fitted profile timing it (no GPU).

Where the planner walk (``mux_whatif.py``) follows one prompt beside a constant decode
batch, this replay keeps the queue: requests arrive at a goodput probe's send times with
its prompt and output lengths, wait first come first served (``waited_ms`` as the engine
reports it), and decode from the step after their last prompt piece. Each step is the
planner's plan over the whole GPU: a mixed step (TEMPORAL), decode alone, or a prefill
alone; the step takes the profile's predicted time. It models the options that keep the
GPU whole (``--mux-sharing temporal``), so it fits a workload whose busy stretch ran mixed
steps (the ShareGPT-like probes at 12-16 req/s); spatial splits and time slices are not
replayed. What it is for: the planner settings' effect at one load, compared with the
settings a measured probe ran (the replay of those settings is the check). Every figure
is a prediction (``"kind": "prediction"``).

With ``--validation`` it replays instead the multiplex run of an H200 simulator validation
(``sim_validate_instance.py``: the Mooncake window it sent, whose busy stretch ran whole-GPU
steps from 8ccd9ac on), the planner starting from the mixed-step corrections the engine had
learned on the probes before that replay (``engine_calibration``), and sets the replayed
P50 / P99 of TTFT and TPOT beside the measured ones, as ``"kind": "validation"``. The
corrections stay as they start: the replay's steps take what the corrected profile says,
so nothing moves them (the engine's moved on through its replay, recorded as
``engine_calibration_after_replay``; that run's end state is also replayed, for the
spread, never as the model).

    cd benchmarks/results/goodput_h200 && python ../../mux_step_replay.py \\
        --record sharegpt__multiplex-graph-floor-bank3-itl60__r16.json --rates 16,18 \\
        --variant "--mux-ttft-pressed-margin 1 --ttft-slo-ms 2000" --out replay.json
    python benchmarks/mux_step_replay.py \\
        --validation benchmarks/results/sim_validate_instance_h200_8ccd9ac.json --out v.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sim_goodput_probes import attainment, measured_rows  # noqa: E402
from benchmarks.sim_validate_instance import latency_rows  # noqa: E402
from benchmarks.validate_sim import percentiles  # noqa: E402
from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.config import SchedulerConfig, add_cli_args  # noqa: E402
from pdserve.sched.in_flight import decode_load_banked  # noqa: E402
from pdserve.sched.multiplex import mux_planner_config  # noqa: E402
from pdserve.sched.mux_planner import (  # noqa: E402
    DecodeLoad,
    MuxMode,
    MuxPlanner,
    MuxPlannerConfig,
    OnlineCalibration,
    PrefillRequest,
)
from pdserve.sched.predictor import LatencyPredictor  # noqa: E402


@dataclass
class Replayed:
    """One request as the replay serves it (times in seconds from the first send)."""

    arrival: float
    prompt_len: int
    output_len: int
    prefilled: int = 0
    decoded: int = 0
    first_token: float | None = None
    finished: float | None = None

    @property
    def num_tokens(self) -> int:
        """The context its next decode reads (``decode_load_over``)."""
        return self.prompt_len + self.decoded

    # What ``banked_slack_ms`` reads of a request: its first token counts as an output.
    @property
    def first_token_time(self) -> float | None:
        return self.first_token

    @property
    def num_output_tokens(self) -> int:
        return self.decoded + 1

    num_placeholders = 0  # the replay samples each token within its step


def planner_config(server_args: str, variant: str = "") -> MuxPlannerConfig:
    """The whole-GPU planner a ``pdserve serve`` command line asks for, ``variant``'s flags
    over it, read as the server reads them (``SchedulerConfig``; graph steps left at
    ``auto`` count as off: the records name them). SM splits and time slices off: not
    replayed."""
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser, SchedulerConfig)
    flags, _ = parser.parse_known_args(shlex.split(server_args) + shlex.split(variant))
    sched = SchedulerConfig(**{f.name: getattr(flags, f.name)
                               for f in dataclasses.fields(SchedulerConfig)})
    return mux_planner_config(sched, spatial=False, temporal=True, time_slice=False)


class StepReplay:
    def __init__(self, planner: MuxPlanner, requests: list[Replayed]) -> None:
        self.planner = planner
        self.pending = deque(sorted(requests, key=lambda r: r.arrival))
        self.now, self.waiting, self.running = 0.0, [], []
        self.modes: dict[str, int] = {}
        self.busy_s = 0.0

    def run(self) -> None:
        while self.pending or self.waiting or self.running:
            self._admit()
            if not (self.waiting or self.running):
                self.now = self.pending[0].arrival
                continue
            self._step()

    def _admit(self) -> None:
        while self.pending and self.pending[0].arrival <= self.now:
            self.waiting.append(self.pending.popleft())

    def _step(self) -> None:
        plan = self.planner.plan(self._decode_load(), self._waiting_view())
        if plan.mode not in (MuxMode.TEMPORAL, MuxMode.DECODE_ONLY, MuxMode.PREFILL_ONLY):
            raise ValueError(f"the replay runs whole-GPU steps only, the planner chose "
                             f"{plan.mode}")
        self.modes[plan.mode] = self.modes.get(plan.mode, 0) + 1
        step_s = plan.cycle_ms / 1e3 if plan.mode != MuxMode.PREFILL_ONLY \
            else plan.prefill.predicted_ms / 1e3
        self.now += step_s
        self.busy_s += step_s
        decoding = list(self.running) if plan.mode != MuxMode.PREFILL_ONLY else []
        self._decode(decoding)
        if plan.prefill is not None:
            self._prefill(plan.prefill.chunks)

    def _decode_load(self) -> DecodeLoad | None:
        return decode_load_banked(self.running, self.planner.config, self.now)

    def _waiting_view(self) -> list[PrefillRequest]:
        return [PrefillRequest(r.prompt_len - r.prefilled, r.prefilled,
                               1e3 * (self.now - r.arrival)) for r in self.waiting]

    def _decode(self, decoding: list[Replayed]) -> None:
        for request in decoding:
            request.decoded += 1
            if request.decoded + 1 >= request.output_len:
                request.finished = self.now
                self.running.remove(request)

    def _prefill(self, chunks) -> None:
        finished = []
        for index, tokens in chunks:
            request = self.waiting[index]
            request.prefilled += tokens
            if request.prefilled >= request.prompt_len:
                finished.append(request)
        for request in finished:
            self.waiting.remove(request)
            request.first_token = self.now
            if request.output_len > 1:
                self.running.append(request)
            else:
                request.finished = self.now


def replay(record: dict, predictor: LatencyPredictor, variant: str = "",
           rate: float | None = None) -> dict:
    """The record's requests replayed with ``variant``'s planner flags; at ``rate`` (req/s)
    their send times are rescaled from the probe's rate to it."""
    config = planner_config(record["config"]["server_args"], variant)
    planner = MuxPlanner(OnlineCalibration(predictor), [], config)
    probed = record["probe"]["rate"]
    scale = probed / rate if rate else 1.0
    requests = [Replayed(s["send_s"] * scale, s["prompt_len"], s["output_tokens"])
                for s in record["samples"]]
    run = StepReplay(planner, requests)
    run.run()
    rows = latency_rows(requests)
    slo = record["summary"]["slo"]
    return {"rate": rate or probed, "variant": variant, "steps": run.modes,
            "busy_s": run.busy_s,
            "attainment": attainment(rows, slo["ttft_ms"] / 1e3, slo["itl_ms"] / 1e3),
            "ttft_s": percentiles(rows, "ttft_s"), "tpot_s": percentiles(rows, "tpot_s")}


def replay_validation(run: dict, predictor: LatencyPredictor) -> dict:
    """A validation run's multiplex replay through whole-GPU steps, from each of the
    engine's recorded calibrations, against its measured requests."""
    from benchmarks.sim_validate_instance import window_requests
    from benchmarks.validate_sim import compare_percentiles
    from pdserve.sim.cluster import LatencyModel

    schedule = run["schedules"]["multiplex"]
    interference = schedule["interference"]
    planner = interference.get("engine_planner", {})
    server_args = (schedule["schedule_args"]
                   + f" --mux-graph-step-tokens {planner.get('graph_step_tokens', 0)}"
                   + f" --mux-mixed-floor-tokens {planner.get('mixed_floor_tokens', 0)}")
    window, _ = window_requests(argparse.Namespace(**run["config"]),
                                LatencyModel(**schedule["latency_model"]))
    replayed, steps = {}, {}
    for name in ("engine_calibration", "engine_calibration_after_replay"):
        requests = [Replayed(r.arrival, r.input_len, r.output_len) for r in window]
        model = OnlineCalibration(predictor)
        model.mixed_correction = interference[name]["mixed_steps"]
        model.graph_mixed_correction = interference[name].get("graph_mixed_steps", 1.0)
        replay_run = StepReplay(MuxPlanner(model, [], planner_config(server_args)), requests)
        replay_run.run()
        replayed[name], steps[name] = latency_rows(requests), replay_run.modes
    measured_rows = schedule["measured_per_request"]
    figures = {key: percentiles(measured_rows, key) for key in ("ttft_s", "tpot_s")}
    return {"kind": "validation", "num_instances": 1, "server_args": server_args,
            "requests": len(window), "steps": steps,
            "compare": compare_percentiles(figures, replayed)}


def measured(record: dict) -> dict:
    rows = measured_rows(record)
    return {"attainment": record["summary"]["slo_attainment"],
            "ttft_s": percentiles(rows, "ttft_s"), "tpot_s": percentiles(rows, "tpot_s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--record", type=Path,
                        help="A goodput probe of multiplexing (goodput_h200.py's JSON).")
    source.add_argument("--validation", type=Path,
                        help="A simulator validation (sim_validate_instance.py's JSON) "
                             "whose multiplex replay to replay.")
    parser.add_argument("--predictor", type=Path, default=None,
                        help="Fitted profile (default: the one the record names).")
    parser.add_argument("--variant", action="append", default=[],
                        help="Planner flags over the record's server flags; repeatable. "
                             "The record's own settings are always replayed first.")
    parser.add_argument("--rates", default="",
                        help="Comma-separated req/s to replay the record's arrivals at, "
                             "rescaled (default: the probe's own rate).")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.validation:
        return validate(args)
    record = json.loads(args.record.read_text())
    predictor_path = args.predictor or ROOT / record["predictor"]["path"]
    predictor = LatencyPredictor.load(predictor_path)
    rates = [float(r) for r in args.rates.split(",") if r] or [None]
    result = {**result_header({"record": _relative(args.record),
                               "predictor": _relative(predictor_path),
                               "variants": args.variant, "rates": args.rates}),
              "kind": "prediction", "record_revision": record["git_revision"],
              "measured": measured(record),
              "replayed": [replay(record, predictor, v, rate) for rate in rates
                           for v in ["", *args.variant]]}
    write_json(result, args.out)
    for row in result["replayed"]:
        print(f"{row['rate']:g} req/s, {row['variant'] or '(as run)'}: "
              f"attainment {row['attainment']:.2f}, "
              f"TTFT p50/p99 {row['ttft_s']['p50']:.2f}/{row['ttft_s']['p99']:.2f} s, "
              f"TPOT p50/p99 {1e3 * row['tpot_s']['p50']:.0f}/"
              f"{1e3 * row['tpot_s']['p99']:.0f} ms")


def validate(args) -> None:
    run = json.loads(args.validation.read_text())
    predictor_path = args.predictor or ROOT / _predictor_of(run["schedules"]["multiplex"])
    result = {**result_header({"validation": _relative(args.validation),
                               "predictor": _relative(predictor_path)}),
              "validation_revision": run["git_revision"],
              **replay_validation(run, LatencyPredictor.load(predictor_path))}
    write_json(result, args.out)
    for key, row in result["compare"].items():
        errors = ", ".join(f"{name[:-6]} {100 * e['p50']:+.1f}% / {100 * e['p99']:+.1f}%"
                           for name, e in row.items() if name.endswith("_error"))
        print(f"{key} P50 / P99: {errors}")


def _predictor_of(schedule: dict) -> str:
    return shlex.split(schedule["schedule_args"])[
        shlex.split(schedule["schedule_args"]).index("--mux-predictor") + 1]


def _relative(path: Path) -> str:
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


if __name__ == "__main__":
    main()
