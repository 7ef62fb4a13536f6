"""The profiler's plumbing on the CPU: every kind of row, a fitted and saved predictor
that ``--schedule multiplex`` then loads. Timings on a CPU mean nothing; shapes do."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pdserve.engine.profiler import (
    CO_QUEUES_MAX,
    QUICK_GRID,
    Profiler,
    ProfileResult,
    Span,
    engine_for_profile,
    main,
    profile_engine,
)
from pdserve.sched.predictor import LatencyPredictor


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiles") / "tiny.json"
    engine = engine_for_profile("tiny", QUICK_GRID, device="cpu", dtype="float32")
    return profile_engine(engine, QUICK_GRID, out), out


def test_profile_records_every_phase_and_saves_a_loadable_predictor(profiled):
    result, path = profiled
    data = json.loads(path.read_text())
    rows = data["rows"]
    kinds = {(r["phase"], r["co_running"]) for r in rows}
    assert kinds == {("decode", False), ("decode", True), ("prefill", False),
                     ("prefill", True), ("mixed", False)}
    assert {r["sms"] for r in rows if r["phase"] == "decode"} == {16, 132}
    assert any(r["num_layers"] == 1 for r in rows if r["phase"] == "prefill"), "pieces"
    assert result.num_rows == len(rows) and result.held_out["n"] > 0
    assert set(data["held_out"]) >= {"median_rel_err", "p95_rel_err"}
    predictor = LatencyPredictor.load(path, "cpu", "tiny")
    assert predictor.num_layers == 4 and predictor.total_sms == 132
    assert predictor.predict("decode", 4, 256, 4, 16, co_running=True) > 0


def test_multiplex_engine_loads_the_saved_profile(profiled):
    from pdserve.config import EngineConfig
    from pdserve.engine.core import EngineCore

    _, path = profiled
    config = EngineConfig.from_flat(model="tiny", device="cpu", dtype="float32",
                                    schedule="multiplex", mux_predictor=str(path),
                                    mux_decode_sms="16")  # the split the profile timed
    engine = EngineCore(config)
    assert isinstance(engine.scheduler.predictor, LatencyPredictor)
    assert engine.describe()["predictor"]["kind"] == "fitted"


def test_a_profile_that_never_timed_a_split_stops_start_up(profiled):
    """The planner could pick 24 decode SMs; a profile of 16 only would have it guess."""
    from pdserve.config import EngineConfig
    from pdserve.engine.core import EngineCore
    from pdserve.sched.predictor import UncoveredGroupsError

    _, path = profiled
    options = dict(model="tiny", device="cpu", dtype="float32", schedule="multiplex",
                   mux_predictor=str(path), mux_decode_sms="16,24")
    with pytest.raises(UncoveredGroupsError, match="24 SMs"):
        EngineCore(EngineConfig.from_flat(**options))
    engine = EngineCore(EngineConfig.from_flat(mux_allow_unprofiled=True, **options))
    source = engine.describe()["predictor"]
    assert source["kind"] == "fitted" and ("decode", 24, True) in [
        tuple(g) for g in source["roofline_for_unprofiled"]]


def test_without_spatial_sharing_the_splits_need_no_profile(profiled):
    """Mixed steps and time slices run on the whole GPU: a profile of the whole GPU is all
    such a planner asks about, so the untimed 24-SM split does not stop start-up."""
    from pdserve.config import EngineConfig
    from pdserve.engine.core import EngineCore

    _, path = profiled
    engine = EngineCore(EngineConfig.from_flat(
        model="tiny", device="cpu", dtype="float32", schedule="multiplex",
        mux_predictor=str(path), mux_decode_sms="16,24", mux_sharing="temporal,time_slice"))
    info = engine.describe()
    assert info["predictor"]["roofline_for_unprofiled"] == []
    assert info["sharing"] == ["temporal", "time_slice"]
    planner = engine.scheduler.planner.config
    assert planner.temporal and planner.time_slice and not planner.spatial


def test_cli_entry_point_parses(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr("pdserve.engine.profiler.profile_engine",
                        lambda engine, grid, out: seen.update(grid=grid, out=out) or
                        ProfileResult("p.json", "cpu", "tiny", 0, {}))
    monkeypatch.setattr("pdserve.engine.profiler.engine_for_profile",
                        lambda model, grid, **options: seen.update(model=model, **options))
    assert main(["tiny", "--quick", "--device", "cpu", "--decode-sms", "8,24",
                 "--out", str(tmp_path)]) == 0
    assert seen["model"] == "tiny" and seen["grid"].decode_sms == (8, 24)
    assert seen["out"] == tmp_path and seen["device"] == "cpu"


class _QueueDrainsIn:
    """Stands in for the GPU side of a co-running phase: each prefill queue drains after
    ``turns`` decode turns; records where each queue's decode turns began."""

    def __init__(self, turns: int, cuda: bool = True):
        self.turns, self.cuda, self.first_points = turns, cuda, []

    def sync(self) -> None:
        pass

    def decode_while(self, part, prefill_end, first_point=0):
        self.first_points.append(first_point)
        return [], self.turns


def _co_running_walk(gpu: _QueueDrainsIn) -> list[int]:
    profiler = object.__new__(Profiler)
    profiler.grid, profiler.clock = QUICK_GRID, gpu
    profiler._queue_pieces = lambda part: [Span(0, 1, {})]
    profiler._decode_while = gpu.decode_while
    profiler._keep_overlapping = lambda pieces, decodes: None
    profiler._co_running(part=None)
    return gpu.first_points


def test_co_running_decode_reaches_every_point_when_a_queue_drains_early():
    gpu = _QueueDrainsIn(turns=3)
    starts = _co_running_walk(gpu)
    points = len(QUICK_GRID.decode_points)
    visited = {(s + k) % points for s in starts for k in range(gpu.turns)}
    assert visited == set(range(points))
    # each queue starts on the point the last one drained in (its steps ran partly past it)
    assert starts == [0, 2, 4, 6]  # eight points in the quick grid


def test_co_running_decode_stops_at_the_queue_limit_and_runs_once_on_a_cpu():
    assert len(_co_running_walk(_QueueDrainsIn(turns=1))) == CO_QUEUES_MAX
    assert _co_running_walk(_QueueDrainsIn(turns=1, cuda=False)) == [0]


class _DecodeStream:
    """A decode stream whose prefill queue drains while turn ``drains_in`` runs; counts
    how far the host's launches got ahead of what it had waited for."""

    cuda = True

    def __init__(self, drains_in: int):
        self.drains_in, self.launched, self.waited, self.most_ahead = drains_in, 0, 0, 0

    def step(self, *args) -> Span:
        self.launched += 1
        self.most_ahead = max(self.most_ahead, self.launched - self.waited)
        turn = (self.launched - 1) // 3  # three steps a turn
        return Span(None, SimpleNamespace(synchronize=lambda t=turn: self._ran(t)), {})

    def _ran(self, turn: int) -> None:
        self.waited = max(self.waited, 3 * (turn + 1))

    def query(self) -> bool:
        return self.waited >= 3 * (self.drains_in + 1)


def test_co_running_decode_counts_the_turns_the_gpu_ran_not_the_ones_launched():
    gpu = _DecodeStream(drains_in=2)
    profiler = object.__new__(Profiler)
    profiler.grid, profiler.clock = QUICK_GRID, gpu
    profiler.fixtures = SimpleNamespace(decode_plan=lambda batch, context: object(),
                                        free=lambda plan: None)
    profiler._co_decode = gpu.step
    part = SimpleNamespace(decode_stream=None)
    spans, passed = profiler._decode_while(part, gpu, first_point=1)
    assert passed == 3  # points 1, 2 and 3: the queue drained in the third
    assert len(spans) == 3 * 4  # one turn launched past the drain, no more
    assert gpu.most_ahead <= 6  # the host stays within one turn of what it waited for
