"""A launch's time on the device: what multiplexing's online calibration learns from."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.engine.launch import Launch
from pdserve.engine.streams import DoneEvent, SyncStreamOps


class TimedEvent(DoneEvent):
    def __init__(self, at_ms: float):
        self.at_ms = at_ms

    def elapsed_time(self, end: TimedEvent) -> float:
        return end.at_ms - self.at_ms


def _launch(start, end, issued: float) -> Launch:
    return Launch(work=None, event=end, buffers=SimpleNamespace(prompt=None), num_sampled=0,
                  want_logprobs=False, launch_ms=0.0, issued=issued, device_start=start)


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
    MultiplexScheduler._calibrate(policy, SimpleNamespace(note=note),
                                  StepOutput([1], elapsed_ms=400.0, device_ms=52.0))
    assert model.mixed_correction == 1.0
    assert entry.measured_cycle_ms == 400.0 and entry.measured_device_ms == 52.0
    MultiplexScheduler._calibrate(policy, SimpleNamespace(note=note),
                                  StepOutput([1], elapsed_ms=60.0))  # no device clock
    assert model.mixed_correction > 1.0
