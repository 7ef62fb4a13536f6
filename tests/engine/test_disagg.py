"""PD-disaggregation on one engine (CPU, emulated partitions): two KV pools, block-free
transfer at the hand-off, tokens identical to chunked prefill."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.setup import EngineSetup
from pdserve.gpu.partitions import Partition
from tests.engine.conftest import hf_greedy
from tests.engine.test_multiplex import HeldOps

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
# Named streams so fake events can hold one lane; on the CPU both are otherwise None.
NAMED = Partition(56, 76, "decode", "prefill", emulated=True)


def _prompts(count: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]  # a common prefix for cache hits
    return [(shared if i % 2 else []) + [rng.randrange(3, vocab)
                                         for _ in range(rng.randrange(1, 90))]
            for i in range(count)]


def _llm(model: str, schedule: str, **options) -> LLM:
    options = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 64, **options}
    return LLM(model, schedule=schedule, **options)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


def _run(engine, prompts, abort=None, ops=None) -> dict[str, list]:
    """Steps by hand, checking both pools after every step. ``abort(engine, step)`` may
    return a request id to abort before that step."""
    tokens = {f"q{i}": [] for i in range(len(prompts))}
    finish = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, GREEDY)
    for step in range(3000):
        if not engine.has_work():
            return {"tokens": tokens, "finish": finish}
        if abort is not None and (victim := abort(engine, step)):
            engine.abort_request(victim)
        if ops is not None and step % 3 == 2:
            ops.release_all()
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
            if update.finished:
                finish[update.request_id] = update.finish_reason
        engine.check_integrity()
    raise AssertionError("did not finish")


def _assert_clean(llm: LLM) -> None:
    sched = llm.engine.scheduler
    llm.engine.check_integrity()
    assert not sched.has_work() and not sched.ready
    assert sched.decode.blocks.num_free_blocks == sched.decode.blocks.num_blocks
    assert sched.prefill.blocks.num_free_blocks == sched.prefill.blocks.num_blocks
    assert llm.engine.kv.local.pending() == 0


@pytest.fixture(scope="module")
def chunked_tiny():
    prompts = _prompts(10, vocab=250)
    return prompts, _generate(_llm("tiny", "chunked"), prompts)


def test_matches_chunked_on_tiny_with_transfer_stats(chunked_tiny):
    prompts, expected = chunked_tiny
    llm = _llm("tiny", "disagg")
    assert _generate(llm, prompts) == expected
    _assert_clean(llm)
    stats = llm.engine.stats()
    assert stats.mux_mode == "disagg" and stats.decode_sms + stats.prefill_sms == 132
    assert stats.decode_sms % 8 == 0 and stats.decode_sms == 56  # 40 percent, rounded up
    assert stats.kv_transfers == len(prompts)
    arch = llm.engine.arch
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4  # float32
    # Each request ships exactly its prompt's KV: no page padding travels.
    assert stats.kv_transfer_bytes == per_token * sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits > 0  # the prefix cache lives in the prefill pool
    timeline = llm.engine.timeline()
    assert timeline and {e["mode"] for e in timeline} == {"disagg"}
    assert timeline[-1]["kv_transfers"] == len(prompts)


def test_matches_chunked_and_transformers_on_llama(hf_llama):
    folder, model = hf_llama
    prompts = _prompts(8, seed=3)
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert _generate(_llm(folder, "chunked"), prompts) == expected
    llm = _llm(folder, "disagg", disagg_prefill_kv_fraction=0.5)
    assert _generate(llm, prompts) == expected
    _assert_clean(llm)


def test_small_decode_pool_waits_and_preempts(chunked_tiny):
    prompts, expected = chunked_tiny
    llm = _llm("tiny", "disagg", num_blocks=56, disagg_prefill_kv_fraction=0.5)
    sched = llm.engine.scheduler
    assert sched.decode.blocks.num_blocks == 28
    seen = {"ready": 0}

    def watch(engine, step):
        seen["ready"] = max(seen["ready"], len(sched.ready))

    got = _run(llm.engine, prompts, abort=watch)
    assert [got["tokens"][f"q{i}"] for i in range(len(prompts))] == expected
    assert seen["ready"] > 0  # prefilled requests waited for decode pages
    assert sched.decode.num_preemptions > 0  # and decode recomputed through prefill
    assert llm.engine.stats().kv_transfers > len(prompts)
    _assert_clean(llm)


def test_request_too_big_for_a_pool_is_refused():
    from pdserve.sampling_params import InvalidRequestError

    llm = _llm("tiny", "disagg", num_blocks=40, disagg_prefill_kv_fraction=0.2)
    with pytest.raises(InvalidRequestError, match="prefill pool"):
        llm.engine.add_request("big", list(range(3, 60)), GREEDY)


def _phase(engine, request_id: str) -> str:
    sched = engine.scheduler
    ids = lambda requests: {r.request_id for r in requests}
    if request_id in ids(sched.waiting):
        return "waiting"
    if request_id in sched.prefill.in_flight:
        return "prefilling"
    if request_id in ids(sched.ready):
        return "transfer"
    if request_id in ids(sched.decode.running):
        return "decoding"
    return "other"


@pytest.mark.parametrize("phase", ["waiting", "prefilling", "transfer", "decoding"])
def test_abort_in_every_phase_keeps_both_pools_clean(chunked_tiny, phase):
    prompts, expected = chunked_tiny
    options = {"num_blocks": 56, "disagg_prefill_kv_fraction": 0.5}
    ops = HeldOps({"prefill", "decode"})
    llm = _llm("tiny", "disagg", setup=EngineSetup(disagg_partition=NAMED, ops=ops), **options)
    state = {"victim": None}

    def abort(engine, step):
        if state["victim"] is not None:
            return None
        for i in range(len(prompts)):
            if _phase(engine, f"q{i}") == phase:
                state["victim"] = f"q{i}"
                return f"q{i}"
        return None

    got = _run(llm.engine, prompts, abort=abort, ops=ops)
    victim = state["victim"]
    assert victim is not None, f"no request was ever {phase}"
    assert got["finish"][victim] == "abort"
    for i, want in enumerate(expected):
        if f"q{i}" != victim:
            assert got["tokens"][f"q{i}"] == want
            assert got["finish"][f"q{i}"] == "length"
    _assert_clean(llm)


@pytest.mark.gpu
def test_disagg_matches_chunked_on_gpu(hf_llama_gpu):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    folder, _ = hf_llama_gpu
    prompts = [p * 4 for p in _prompts(12, seed=1, vocab=1000)]
    common = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=16,
                  num_blocks=4096)  # an explicit pool: two engines share the GPU here
    chunked = _generate(LLM(folder, schedule="chunked", chunk_size=256, **common), prompts)
    llm = LLM(folder, schedule="disagg", max_num_batched_tokens=256, **common)
    assert _generate(llm, prompts) == chunked
    _assert_clean(llm)
    partition = llm.engine.scheduler.partition
    graphs = llm.engine.runner.pools["decode"].graphs.get(partition.decode_sms)
    assert graphs is not None and graphs.stream is partition.decode_stream
    assert llm.engine.stats().kv_transfers == len(prompts)
