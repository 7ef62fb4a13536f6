"""The profiler's plumbing on the CPU: every kind of row, a fitted and saved predictor
that ``--schedule multiplex`` then loads. Timings on a CPU mean nothing; shapes do."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from types import SimpleNamespace

import pytest

from pdserve.engine.profiler import (
    CO_COVER,
    QUICK_GRID,
    STEPS_PER_TURN,
    ProfileGrid,
    Profiler,
    ProfileResult,
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


class _Event:
    """A CUDA event on the fake GPU's timeline: the time its stream reached it."""

    def __init__(self, gpu: _FakeGpu, at: float):
        self.gpu, self.at = gpu, at

    def elapsed_time(self, other: _Event) -> float:
        return other.at - self.at

    def query(self) -> bool:
        return self.gpu.host >= self.at

    def synchronize(self) -> None:
        self.gpu.host = max(self.gpu.host, self.at)
        self.gpu.waited = max(self.gpu.waited, sum(end <= self.at for end in self.gpu.step_ends))


class _FakeGpu:
    """Stands in for the GPU under a co-running phase: one timeline per stream, in ms. A
    prefill piece takes ``PIECE_MS`` per token and layer, a decode step time that grows
    with its batch and falls with its SMs, ``contention`` times as long while the prefill
    stream is busy; issuing a piece takes the host ``LAUNCH_MS``. Records each turn (the
    launches between two waits) and how many decode steps the host got ahead of a wait."""

    cuda = True
    PIECE_MS, LAUNCH_MS = 0.002, 2.0

    def __init__(self, contention: float = 1.5):
        self.contention, self.host = contention, 0.0
        self.free_at = {"prefill": 0.0, "decode": 0.0}
        self.turns: list[dict] = []
        self._turn = dict(pieces=0, queue_ms=0.0, steps=0, point=None)
        self.launched = self.waited = self.most_ahead = 0  # decode steps
        self.step_ends: list[float] = []

    @staticmethod
    def step_alone_ms(batch: int, sms: int) -> float:
        return (20 + batch) * 16 / sms

    # the clock

    def mark(self, stream: str) -> _Event:
        self.free_at[stream] = max(self.free_at[stream], self.host)
        return _Event(self, self.free_at[stream])

    def ms(self, start: _Event, end: _Event) -> float:
        return end.at - start.at

    def sync(self) -> None:
        self.host = max(self.host, *self.free_at.values())
        self.waited = self.launched
        if self._turn["steps"] and self._turn["pieces"]:  # a co-running turn
            self.turns.append(self._turn)
        self._turn = dict(pieces=0, queue_ms=0.0, steps=0, point=None)

    # the runner

    def launch(self, work, waits, buffers) -> SimpleNamespace:
        stream = work.side
        if work.layers is not None:
            self.host += self.LAUNCH_MS
            ms = self.PIECE_MS * work.plan.tokens * work.layers[1]
            self._turn["pieces"] += 1
            self._turn["queue_ms"] += ms
        else:
            ms = self.step_alone_ms(work.plan.batch, work.partition.decode_sms)
            if self.free_at["prefill"] > max(self.free_at["decode"], self.host):
                ms *= self.contention
            self.launched += 1
            self.most_ahead = max(self.most_ahead, self.launched - self.waited)
            point = (work.partition.decode_sms, work.plan.batch, work.plan.context)
            self._turn.update(steps=self._turn["steps"] + 1, point=point)
        self.free_at[stream] = max(self.free_at[stream], self.host) + ms
        if work.layers is None:
            self.step_ends.append(self.free_at[stream])
        return SimpleNamespace(launch_ms=self.LAUNCH_MS)


def _split(decode_sms: int) -> SimpleNamespace:
    # streams named after the sides, so the fake's launches find their timeline by side
    return SimpleNamespace(decode_sms=decode_sms, prefill_sms=132 - decode_sms,
                           decode_stream="decode", prefill_stream="prefill", whole_gpu=False)


def _profile_on_fake_gpu(gpu: _FakeGpu, splits=(16, 64)) -> Profiler:
    """The alone and co-running phases of ``ProfileGrid()`` on ``gpu``, as ``run`` orders
    them (the co-running phase sizes its queues from the alone rows)."""
    profiler = object.__new__(Profiler)
    profiler.grid, profiler.clock, profiler.buffers = ProfileGrid(), gpu, None
    profiler.ops = SimpleNamespace(on=lambda stream: contextlib.nullcontext())
    profiler.runner = SimpleNamespace(model=SimpleNamespace(num_layers=48), launch=gpu.launch)
    profiler.fixtures = SimpleNamespace(
        decode_plan=lambda batch, context: SimpleNamespace(batch=batch, context=context),
        prefill_plan=lambda tokens, prefix: SimpleNamespace(tokens=tokens),
        free=lambda plan: None, release=lambda: None)
    profiler.rows, profiler.launch_ms, profiler.messages = [], [], []
    profiler.progress = profiler.messages.append
    for sms in splits:
        part = _split(sms)
        for phase in (profiler._decode_alone, profiler._prefill_alone, profiler._co_running):
            phase(part)
    return profiler


def _co_running_rows(profiler: Profiler, phase: str) -> list[dict]:
    return [r for r in profiler.rows if r["phase"] == phase and r["co_running"]]


def _kept_decode_steps(profiler: Profiler) -> Counter:
    """Co-running decode rows by (decode SMs, batch, context per request)."""
    return Counter((r["sms"], r["batch_size"], r["context_tokens"] // r["batch_size"])
                   for r in _co_running_rows(profiler, "decode"))


def test_co_running_keeps_decode_rows_for_every_point_on_every_partition():
    """Large batches on few decode SMs included: one queue run until it drained reached
    batch 16 at most on 16-32 decode SMs of the H200."""
    gpu = _FakeGpu()
    profiler = _profile_on_fake_gpu(gpu)
    kept = _kept_decode_steps(profiler)
    for sms in (16, 64):
        for point in ProfileGrid().decode_points:
            assert kept[sms, *point] == STEPS_PER_TURN, (sms, point)
    assert {r["sms"] for r in _co_running_rows(profiler, "prefill")} == {116, 68}
    assert [t["point"] for t in gpu.turns] == [
        (sms, *point) for sms in (16, 64) for point in ProfileGrid().decode_points]
    assert profiler.messages == []


def test_the_host_never_launches_more_than_one_turn_ahead_of_what_it_waited_for():
    gpu = _FakeGpu()
    _profile_on_fake_gpu(gpu)
    assert gpu.most_ahead == STEPS_PER_TURN


def test_a_slower_decode_point_gets_a_longer_prefill_queue():
    gpu = _FakeGpu()
    _profile_on_fake_gpu(gpu)
    pieces = {t["point"]: t["pieces"] for t in gpu.turns}
    assert pieces[16, 128, 1024] > 3 * pieces[16, 1, 1024]  # 148 ms a step alone, not 21
    assert pieces[16, 128, 1024] > pieces[64, 128, 1024]  # the same batch, 4x the SMs
    most = ProfileGrid().co_rounds_max * len(ProfileGrid().co_prefill_points)
    assert max(pieces.values()) <= most


def test_a_point_whose_steps_were_not_all_kept_runs_once_more_beside_a_queue_twice_as_long():
    """2.5 times as slow beside prefill: past the queue's cover of two, within four (and
    the grid's slowest turn, 160 requests on 16 SMs, within the bound of its rounds)."""
    gpu = _FakeGpu(contention=2.5)
    profiler = _profile_on_fake_gpu(gpu)
    queues: dict[tuple[int, int, int], list[dict]] = {}
    for turn in gpu.turns:
        queues.setdefault(turn["point"], []).append(turn)
    assert all(len(turns) <= 2 for turns in queues.values())
    most = ProfileGrid().co_rounds_max * len(ProfileGrid().co_prefill_points)
    retried = {point: turns for point, turns in queues.items()
               if len(turns) == 2 and turns[1]["pieces"] < most}
    assert len(retried) >= 10  # of 22 points; the others' first queue ran long enough
    for (sms, batch, _), (first, second) in retried.items():
        # what the GPU still had queued once the host had issued it all
        outlasts = lambda queue: queue["queue_ms"] - queue["pieces"] * gpu.LAUNCH_MS
        turn_alone = STEPS_PER_TURN * gpu.step_alone_ms(batch, sms)
        assert outlasts(first) >= CO_COVER * turn_alone
        assert outlasts(second) >= 2 * CO_COVER * turn_alone
    kept = _kept_decode_steps(profiler)
    assert all(kept[point] >= STEPS_PER_TURN for point in queues)
    assert profiler.messages == []


def test_a_point_never_kept_is_retried_once_only_and_named():
    gpu = _FakeGpu(contention=100.0)
    profiler = _profile_on_fake_gpu(gpu, splits=(16,))
    points = ProfileGrid().decode_points
    assert [t["point"] for t in gpu.turns] == [(16, *p) for p in points for _ in range(2)]
    assert all(t["steps"] == STEPS_PER_TURN for t in gpu.turns)
    most = ProfileGrid().co_rounds_max * len(ProfileGrid().co_prefill_points)
    assert max(t["pieces"] for t in gpu.turns) == most  # a retry stops at the bound
    assert profiler.messages == [
        f"co-running on 16 SMs: (batch, context) points with a step not kept beside "
        f"prefill, or no KV room: {list(points)}"]
