"""PD-multiplexing end to end on a tiny model: the same code path as on the GPU, with
emulated partitions (CPU) and fake events that complete late, in any order, or on command."""

from __future__ import annotations

import math
import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.setup import EngineSetup
from pdserve.engine.streams import SyncStreamOps
from pdserve.gpu.driver import FakeDriver
from pdserve.gpu.partitions import PartitionSet
from tests.engine.conftest import hf_greedy

MAX_NEW = 10
SMS = 132


class SplitModel:
    """Latencies that make spatial sharing win (mixed steps never fit) and move the best
    split with the decode batch: 16 decode SMs up to ~5 requests, 24 or 32 beyond."""

    total_sms = SMS

    def __init__(self, num_layers: int):
        self.num_layers = num_layers

    def predict(self, phase, num_tokens, context_tokens, batch_size, sms, co_running=False,
                num_layers=None):
        co = co_running and sms < SMS
        if phase == "decode":
            ms = (2 + 2 * batch_size + context_tokens / 1e3) * (SMS / sms) ** 0.5
            return ms * (1.3 if co else 1.0)
        share = (num_layers or self.num_layers) / self.num_layers
        return share * (1 + 0.3 * num_tokens) * SMS / sms * (1.2 if co else 1.0)

    def predict_mixed(self, *args, **kwargs):
        return 1e6


class StepEvent:
    """Done a set number of engine steps after it was recorded (``StepOps.tick``)."""

    def __init__(self, steps: int):
        self.left = steps

    def query(self) -> bool:
        return self.left <= 0

    def synchronize(self) -> None:
        self.left = 0


class StepOps(SyncStreamOps):
    """Each launch completes 1 to ``most`` engine steps after it was issued (seeded): launches
    finish late and out of order, and what is in flight at each step never depends on the
    host's speed (an event done after N *queries* did: the engine polls for a while, and a
    busy host polls fewer times)."""

    def __init__(self, seed: int, most: int = 3):
        self.rng, self.most, self.pending = random.Random(seed), most, []

    def record(self, stream):
        event = StepEvent(self.rng.randint(1, self.most))
        self.pending.append(event)
        return event

    def wait(self, stream, event) -> None:
        return None

    def tick(self) -> None:
        for event in self.pending:
            event.left -= 1
        self.pending = [e for e in self.pending if e.left > 0]


def ticking(llm: LLM, ops: StepOps) -> LLM:
    """Every engine step first moves the fake device on by one step."""
    engine, step = llm.engine, llm.engine.step

    def ticked():
        ops.tick()
        return step()

    engine.step = ticked
    return llm


class HeldOps(SyncStreamOps):
    """Events on ``held`` streams complete only when released; others at once."""

    def __init__(self, held):
        self.held = set(held)
        self.log: list[tuple] = []

    def record(self, stream):
        event = StepEvent(10**9 if stream in self.held else 0)
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream, event):
        self.log.append(("wait", stream, event))

    def release_all(self) -> None:
        for _, _, event in self.log:
            event.left = 0


def _prompts(count: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # a common prefix for cache hits
    prompts = []
    for i in range(count):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 90))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


def _multiplex(folder: str, predictor=None, ops=None, partitions=None, **options) -> LLM:
    # Spatial and mixed steps unless a test asks for time slicing, which otherwise wins
    # under SplitModel's latencies.
    options = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 64,
               "mux_sharing": "temporal,spatial", **options}
    setup = EngineSetup(partitions=partitions, predictor=predictor, ops=ops)
    llm = LLM(folder, schedule="multiplex", setup=setup, **options)
    # Steps are timed by the host's clock, which on a busy CPU says nothing about the fake
    # latencies these tests plan with: learning from it, or forcing prefill in once a prompt
    # has waited two seconds of that clock, made decisions (and tests) depend on machine
    # load. Calibration and the stall rule have their own tests (tests/sched/).
    scheduler = llm.engine.scheduler
    scheduler.set_predictor(scheduler.predictor, max_prefill_stall_ms=math.inf)
    scheduler.model.weight = 0.0
    return ticking(llm, ops) if isinstance(ops, StepOps) else llm


def _run(engine, prompts, params, check=None, abort_at=None) -> dict[str, list[int]]:
    """Drives ``engine.step`` by hand; ``check(policy)`` runs after every step."""
    tokens = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
        tokens[f"q{i}"] = []
    for step in range(5000):
        if not engine.has_work():
            return tokens
        if abort_at is not None and step == abort_at[1]:
            engine.abort_request(abort_at[0])
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
        if check is not None:
            check(engine.scheduler)
    raise AssertionError("did not finish")


@pytest.fixture(scope="module")
def expected(hf_llama):
    _, model = hf_llama
    prompts = _prompts(10)
    return prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert not llm.engine.scheduler.in_flight and not llm.engine.requests


def test_roofline_default_matches_chunked_and_transformers(hf_llama, expected):
    folder, _ = hf_llama
    prompts, want = expected
    chunked = _generate(LLM(folder, dtype="float32", block_size=8, schedule="chunked",
                            chunk_size=64), prompts)
    llm = _multiplex(folder)
    assert _generate(llm, prompts) == chunked == want
    _assert_clean(llm)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.mux_mode
    modes = {e["mode"] for e in llm.engine.timeline()}
    assert "prefill_only" in modes and modes & {"temporal", "decode_only", "spatial"}


def test_spatial_pieces_match_transformers(hf_llama, expected):
    folder, _ = hf_llama
    prompts, want = expected
    llm = _multiplex(folder, predictor=SplitModel(2))
    assert _generate(llm, prompts) == want
    _assert_clean(llm)
    timeline = llm.engine.timeline()
    spatial = [e for e in timeline if e["mode"] == "spatial"]
    assert spatial and any(0 < e["prefill_layers"] < 2 for e in spatial), "layer pieces"
    assert len({e["decode_sms"] for e in spatial}) > 1, "the split follows the decode batch"
    assert all(e["decode_sms"] + e["prefill_sms"] == SMS for e in spatial)
    whole = [e for e in timeline if e["mode"] == "prefill_only"]
    assert any(e["prefill_layers"] == 2 for e in whole), "alone, prefill runs every layer"
    # The shared prefix is cached after the first prompt: later pieces start behind it.
    assert any(e["prefill_context_tokens"] > 0 for e in spatial + whole)
    assert all(e["prefill_context_tokens"] == 0 for e in timeline if e["prefill_tokens"] == 0)
    # Each sharing choice says the rate it was chosen by (over the work it commits to).
    assert all(e["committed_tokens_per_s"] > 0 for e in spatial)


def test_prefill_on_a_partition_tells_attention_its_sms(hf_llama, expected):
    """The extend kernel's split count counts the SMs a launch runs on: a spatial piece's
    metadata carries its partition's prefill SMs, an eager decode on a split its decode
    SMs, a whole-GPU launch none (the device's)."""
    folder, _ = hf_llama
    prompts, want = expected
    llm = _multiplex(folder, predictor=SplitModel(2))
    model, prompt_sms, decode_sms = llm.engine.runner.model, [], []
    forward_layers, forward = model.forward_layers, model.forward

    def record(meta):
        (decode_sms if meta.num_decode_seqs == meta.num_seqs else prompt_sms).append(
            meta.launch_sms)

    def layers_recording(hidden, residual, positions, meta, *args):
        record(meta)
        return forward_layers(hidden, residual, positions, meta, *args)

    def forward_recording(input_ids, positions, meta, *args):
        record(meta)
        return forward(input_ids, positions, meta, *args)

    model.forward_layers, model.forward = layers_recording, forward_recording
    assert _generate(llm, prompts) == want
    spatial = [e for e in llm.engine.timeline() if e["mode"] == "spatial"]
    assert spatial and all(e["prefill_sms"] < SMS for e in spatial)
    assert set(prompt_sms) - {None} == {e["prefill_sms"] for e in spatial}
    assert None in prompt_sms  # prefill alone and mixed steps on the whole GPU
    splits = {p.decode_sms for p in llm.engine.scheduler.graph_partitions() if not p.whole_gpu}
    assert set(decode_sms) - {None} <= splits


def test_warm_up_runs_a_partition_chunk_on_its_prefill_sms(hf_llama):
    """A warm-up shape naming a partition's prefill SMs runs its chunk alone there (the
    extend split counts only a partition launches compile before serving); without SMs,
    beside a decode on the whole GPU; the fixtures leave nothing behind."""
    from pdserve.engine.warmup import run_shapes

    folder, _ = hf_llama
    llm = _multiplex(folder, predictor=SplitModel(2))
    parts = [p for p in llm.engine.scheduler.graph_partitions() if not p.whole_gpu]
    sms = max(p.prefill_sms for p in parts)
    model, seen = llm.engine.runner.model, []
    forward = model.forward

    def recording(input_ids, positions, meta, *args):
        seen.append((meta.launch_sms, meta.num_decode_seqs))
        return forward(input_ids, positions, meta, *args)

    model.forward = recording
    assert run_shapes(llm.engine, 16, [(1, 8, 16, sms), (1, 8, 16)])["steps"] == 2
    assert seen == [(sms, 0), (None, 1)]
    _assert_clean(llm)


def test_late_out_of_order_completions_keep_tokens_and_the_split_rule(hf_llama, expected):
    folder, _ = hf_llama
    prompts, want = expected
    partitions = PartitionSet.build(FakeDriver(), [16, 24, 32, 48, 64])
    ops = StepOps(seed=3)
    llm = _multiplex(folder, predictor=SplitModel(2), ops=ops, partitions=partitions)
    overlaps = []

    def check(policy):
        decode, piece = policy.decode_work, policy.piece_work
        if decode is not None and piece is not None:
            overlaps.append(policy.current.decode_sms)
            # Both lanes in flight always share one split: SM sets of splits overlap.
            assert decode.partition == piece.partition == policy.current
            assert not policy.current.whole_gpu

    got = _run(llm.engine, prompts, GREEDY, check)
    assert [got[f"q{i}"] for i in range(len(prompts))] == want
    assert overlaps, "decode and prefill were in flight together"
    _assert_clean(llm)


def test_preemption_and_abort_under_lagging_completions(hf_llama, expected):
    folder, _ = hf_llama
    prompts, want = expected
    # 20 blocks of 8 tokens cannot hold 10 requests of up to 140 tokens: forces preemption.
    llm = _multiplex(folder, predictor=SplitModel(2), ops=StepOps(seed=5), num_blocks=20,
                     partitions=PartitionSet.build(FakeDriver(), [16, 24, 32]))
    got = _run(llm.engine, prompts, GREEDY, abort_at=("q3", 12))
    for i, tokens in enumerate(want):
        if i != 3:
            assert got[f"q{i}"] == tokens
    assert got["q3"] == want[3][: len(got["q3"])]
    assert llm.engine.stats().num_preemptions > 0
    _assert_clean(llm)


def test_long_prompts_run_as_bounded_batches(hf_llama):
    folder, model = hf_llama
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (300, 5, 170)]
    llm = _multiplex(folder, predictor=SplitModel(2), max_num_batched_tokens=64)
    assert _generate(llm, prompts) == [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert all(e["prefill_tokens"] <= 64 for e in llm.engine.timeline())
    _assert_clean(llm)


class SliceModel(SplitModel):
    """Co-running costs decode ten times over: only whole-GPU time slicing fits the SLO."""

    def predict(self, phase, num_tokens, context_tokens, batch_size, sms, co_running=False,
                num_layers=None):
        ms = super().predict(phase, num_tokens, context_tokens, batch_size, sms, False,
                             num_layers)
        return ms * 10 if co_running and sms < SMS else ms


@pytest.mark.parametrize("seed", [0, 3])
def test_time_slicing_alternates_lanes_and_matches_transformers(hf_llama, expected, seed):
    folder, _ = hf_llama
    prompts, want = expected
    llm = _multiplex(folder, predictor=SliceModel(2), ops=StepOps(seed=seed),
                     partitions=PartitionSet.build(FakeDriver(), [16, 32]),
                     mux_sharing="temporal,time_slice,spatial")
    seen = []

    def check(policy):
        decode, piece = policy.decode_work, policy.piece_work
        if decode is not None and piece is not None and policy.time_slicing:
            seen.append(decode.partition)
            assert decode.partition.whole_gpu and piece.partition.whole_gpu

    got = _run(llm.engine, prompts, GREEDY, check)
    assert [got[f"q{i}"] for i in range(len(prompts))] == want
    assert seen, "a decode and a piece were in flight together on the whole GPU"
    _assert_clean(llm)
    timeline = llm.engine.timeline()
    sliced = [e for e in timeline if e["mode"] == "time_slice"]
    assert sliced and not [e for e in timeline if e["mode"] == "spatial"]
    assert all(e["decode_sms"] == e["prefill_sms"] == SMS for e in sliced)
    assert any(e["measured_cycle_ms"] > 0 and e["predicted_cycle_ms"] > 0 for e in sliced)


def _held_engine(folder):
    partitions = PartitionSet.build(FakeDriver(), [16, 24, 32])
    ops = HeldOps({p.prefill_stream for p in partitions.choices()})
    llm = _multiplex(folder, predictor=SplitModel(2), ops=ops, partitions=partitions)
    engine = llm.engine
    runner, engine.decode_launches = engine.runner, []
    launch = runner.launch

    def spy(work, *args, **kwargs):
        result = launch(work, *args, **kwargs)
        if work.side == "decode":
            engine.decode_launches.append(result)
        return result

    runner.launch = spy
    return engine, ops


def _decoding(launch) -> set[str]:
    return {s.request.request_id for s in launch.plan.decodes}


def _decode_until_running(engine, request_id: str):
    """Steps until a decode launch carries ``request_id``; returns that launch."""
    for _ in range(50):
        engine.step()
        for launch in engine.decode_launches:
            if request_id in _decoding(launch):
                return launch
    raise AssertionError(f"{request_id} never decoded")


def _prefilling(launch, request_id: str) -> bool:
    return launch is not None and any(s.request.request_id == request_id
                                      for s in launch.plan.prefills)


def test_finished_prefill_joins_decode_only_after_its_event(hf_llama):
    folder, _ = hf_llama
    engine, ops = _held_engine(folder)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params)
    _decode_until_running(engine, "a")  # alone: a whole-GPU prefill, not held
    engine.add_request("b", list(range(50, 120)), params)
    for _ in range(100):  # release piece by piece until b's last piece is in flight
        engine.step()
        piece = engine.in_flight("prefill")
        if piece is not None and piece.work.final and any(
                s.request.request_id == "b" and s.samples for s in piece.plan.prefills):
            break  # the piece that ends b's prompt
        ops.release_all()
    final_event = engine.in_flight("prefill").event
    for _ in range(10):  # held: b's tokens may be computed, but it must not decode yet
        engine.step()
        assert "b" in engine.scheduler.in_flight
    assert not any("b" in _decoding(launch) for launch in engine.decode_launches)
    ops.release_all()
    first = _decode_until_running(engine, "b")
    log = ops.log
    decode_record = next(i for i, (kind, _, e) in enumerate(log)
                         if kind == "record" and e is first.event)
    stream_of_first = first.work.partition.decode_stream
    waits = [i for i, (kind, stream, e) in enumerate(log)
             if kind == "wait" and e is final_event and stream == stream_of_first]
    assert waits and waits[0] < decode_record, "decode stream waits on the prefill's event"


def test_abort_of_a_request_whose_piece_is_in_flight_waits_for_the_piece(hf_llama):
    folder, _ = hf_llama
    engine, ops = _held_engine(folder)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params)
    _decode_until_running(engine, "a")
    engine.add_request("b", list(range(50, 300)), params)
    for _ in range(3):
        engine.step()
    assert _prefilling(engine.in_flight("prefill"), "b") and "b" in engine.scheduler.in_flight
    blocks_of_b = list(engine.requests["b"].block_ids)
    engine.abort_request("b")
    for _ in range(3):
        assert not [u for u in engine.step() if u.request_id == "b"]
    assert engine.requests["b"].block_ids == blocks_of_b, "blocks stay while kernels use them"
    ops.release_all()
    aborted = []
    for _ in range(5):
        aborted += [u for u in engine.step() if u.request_id == "b"]
    assert aborted and aborted[-1].finished and aborted[-1].finish_reason == "abort"
    assert "b" not in engine.requests and "b" not in engine.scheduler.in_flight
    assert not _prefilling(engine.in_flight("prefill"), "b"), "the rest of its layers never run"
    engine.abort_request("a")
    for _ in range(10):
        ops.release_all()
        engine.step()
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("planner", ["roofline", "spatial", "time_slice"])
def test_multiplex_matches_chunked_on_gpu(hf_llama_gpu, planner):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    folder, _ = hf_llama_gpu
    prompts = _prompts(12, seed=1, vocab=1000)
    prompts = [p * 4 for p in prompts]  # hundreds of tokens: several batches and pieces
    common = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=16,
                  num_blocks=4096)  # an explicit pool: two engines share the GPU here
    chunked = _generate(LLM(folder, schedule="chunked", chunk_size=256, **common), prompts)
    predictor = {"spatial": SplitModel(4), "time_slice": SliceModel(4)}.get(planner)
    llm = _multiplex(folder, predictor=predictor, max_num_batched_tokens=256,
                     mux_predictor="roofline",
                     mux_sharing="temporal,time_slice,spatial" if planner == "time_slice"
                     else "temporal,spatial", **common)
    policy, graph_sets = llm.engine.scheduler, llm.engine.runner.pools["main"].graphs
    got = _generate(llm, prompts)
    assert got == chunked
    _assert_clean(llm)
    # One graph set per partition (and the whole GPU), each captured on its decode stream.
    parts = [*policy.partitions.choices(), policy.partitions.whole_gpu]
    assert set(graph_sets) == {p.decode_sms for p in parts}
    for part in parts:
        graphs = graph_sets[part.decode_sms]
        assert graphs.stream is part.decode_stream and graphs.graphs
    if planner != "roofline":
        assert any(e["mode"] == planner for e in llm.engine.timeline())


class MixedModel(SplitModel):
    """Mixed steps at 0.15 ms a token: the 60 ms target's budget (54 ms) holds 360 tokens,
    so a step cut to 128-token tiles holds 256 of them."""

    def predict_mixed(self, prefill_tokens, prefill_context, prefill_batch, decode_batch,
                      decode_context, sms=None):
        return 0.15 * (prefill_tokens + decode_batch)


def test_mixed_steps_aligned_to_128_tokens_match_chunked(hf_llama):
    """``--mux-align-step-tokens --mux-token-align 128``: every mixed step that cuts a
    prompt holds a whole number of 128-token tiles, the decodes counted; the tokens are
    chunked prefill's."""
    folder, _ = hf_llama
    rng = random.Random(3)
    lengths = [rng.randrange(150, 225) * 2 + 1 for _ in range(4)]  # odd: no cut ends on one
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    chunked = _generate(LLM(folder, dtype="float32", block_size=8, schedule="chunked",
                            chunk_size=64), prompts)
    llm = _multiplex(folder, predictor=MixedModel(2), max_num_batched_tokens=2048,
                     itl_slo_ms=60.0, mux_sharing="temporal", mux_align_step_tokens=True,
                     mux_token_align=128)
    engine, tokens = llm.engine, {f"q{i}": [] for i in range(len(prompts))}
    engine.add_request("q0", prompts[0], GREEDY)
    while not tokens["q0"]:  # the others arrive while it decodes: mixed steps
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
    for i, prompt in enumerate(prompts[1:], 1):
        engine.add_request(f"q{i}", prompt, GREEDY)
    while engine.has_work():
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
    assert [tokens[f"q{i}"] for i in range(len(prompts))] == chunked
    _assert_clean(llm)
    mixed = [e for e in llm.engine.timeline() if e["mode"] == "temporal" and e["decode_batch"]]
    cuts = [e for e in mixed if not any(start + size in lengths
                                        for start, size in e["prefill_pieces"])]
    assert cuts, [(e["prefill_pieces"], e["decode_batch"]) for e in mixed]
    assert all((e["prefill_tokens"] + e["decode_batch"]) % 128 == 0 for e in cuts)
