"""A launch's time on the device: what multiplexing's online calibration learns from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine.launch import Launch
from pdserve.engine.streams import DoneEvent, SyncStreamOps


class TimedEvent(DoneEvent):
    def __init__(self, at_ms: float):
        self.at_ms = at_ms

    def elapsed_time(self, end: TimedEvent) -> float:
        return end.at_ms - self.at_ms


def _launch(start, end, issued: float) -> Launch:
    return Launch(work=None, event=end, buffers=SimpleNamespace(prompt=None, embed=None),
                  num_sampled=0, want_logprobs=False, launch_ms=0.0, issued=issued,
                  device_start=start)


def test_device_time_runs_between_the_launchs_own_events():
    # Looked at 0.4 s after it was issued (the host was busy elsewhere): the host's view
    # says 400 ms, the device's clock the 52 ms the step took.
    import time

    output = _launch(TimedEvent(10.0), TimedEvent(62.0), time.perf_counter() - 0.4).output()
    assert output.device_ms == 52.0
    assert output.elapsed_ms >= 400.0


def test_without_a_device_clock_only_the_host_times_it():
    assert SyncStreamOps().timed_record(None) is None
    output = _launch(None, DoneEvent(), 0.0).output()
    assert output.device_ms is None and output.elapsed_ms > 0


def test_mixed_step_correction_learns_from_the_device_clock():
    """A mixed step that took its predicted 52 ms on the GPU but was seen done 400 ms after
    its issue leaves the correction where it was; the timeline keeps both views."""
    from pdserve.sched.base import StepOutput
    from pdserve.sched.multiplex import DecodeNote, MixedNote, MultiplexScheduler, TimelineEntry
    from pdserve.sched.mux_planner import OnlineCalibration

    model = OnlineCalibration(SimpleNamespace(num_layers=48, total_sms=132))
    entry = TimelineEntry(0.0, "temporal", 132, 132, 1, 256, 0, 52.0, False, 52.0)
    note = DecodeNote(entry=entry, mixed=MixedNote(plan=SimpleNamespace(decode_ms=52.0),
                                                   as_planned=True))
    policy = SimpleNamespace(model=model)
    MultiplexScheduler._calibrate(policy, SimpleNamespace(note=note, path="piecewise_graph"),
                                  StepOutput([1], elapsed_ms=400.0, device_ms=52.0))
    assert model.mixed_correction == 1.0
    assert entry.measured_cycle_ms == 400.0 and entry.measured_device_ms == 52.0
    assert entry.path == "piecewise_graph"
    MultiplexScheduler._calibrate(policy, SimpleNamespace(note=note, path="piecewise_graph"),
                                  StepOutput([1], elapsed_ms=60.0))  # no device clock
    assert model.mixed_correction > 1.0


@pytest.mark.parametrize("mode, learns", [("decode_only", "alone"), ("time_slice", "alone"),
                                           ("spatial", "co_running"), ("temporal", None)])
def test_a_decode_step_teaches_the_factor_of_where_it_ran(mode, learns):
    """Decode alone on the whole GPU (decode-only steps, time slices' decodes) and decode
    beside a prefill on an SM split learn separate factors; a mixed step neither."""
    from pdserve.sched.base import StepOutput
    from pdserve.sched.multiplex import DecodeNote, MultiplexScheduler, TimelineEntry
    from pdserve.sched.mux_planner import OnlineCalibration

    model = OnlineCalibration(SimpleNamespace(num_layers=48, total_sms=132))
    entry = TimelineEntry(0.0, mode, 132, 132, 140, 0, 0, 24.0, False, 24.0)
    policy = SimpleNamespace(model=model)
    work = SimpleNamespace(note=DecodeNote(entry=entry), path="decode_graph")
    MultiplexScheduler._calibrate(policy, work, StepOutput([1], elapsed_ms=40.0, device_ms=31.0))
    assert (model.alone_decode_correction > 1.0) == (learns == "alone")
    assert (model.decode_correction > 1.0) == (learns == "co_running")
    assert model.mixed_correction == 1.0


class ClockOps(SyncStreamOps):
    """A device clock on the CPU: each timing event reads 10 ms after the one before."""

    def __init__(self):
        self.timed = 0

    def timed_record(self, stream):
        self.timed += 1
        return TimedEvent(10.0 * self.timed)


def _run(schedule: str) -> tuple[ClockOps, list[dict]]:
    from pdserve.engine.llm import LLM
    from pdserve.engine.setup import EngineSetup
    from pdserve.sampling_params import SamplingParams

    ops = ClockOps()
    llm = LLM("tiny", device="cpu", schedule=schedule, mux_predictor="roofline",
              max_num_batched_tokens=64, setup=EngineSetup(ops=ops))
    llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return ops, llm.engine.timeline()


@pytest.mark.parametrize("schedule", ["chunked", "prefill-first", "multiplex"])
def test_timed_launches_reach_the_timeline_on_the_device_clock(schedule):
    """Multiplexing times the launches it calibrates against; the whole-GPU policies time
    every step, for their step timeline. Each timed launch records a start and an end."""
    ops, timeline = _run(schedule)
    assert ops.timed > 0 and ops.timed % 2 == 0
    assert any(e["measured_device_ms"] == 10.0 for e in timeline)
    if schedule != "multiplex":
        assert ops.timed == 2 * len(timeline)
        assert all(e["measured_device_ms"] == 10.0 for e in timeline)
