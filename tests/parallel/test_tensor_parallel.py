"""Tensor parallelism on the CPU: two ranks (the engine and one worker process) over gloo.

Greedy tokens at TP=2 equal TP=1's and transformers' on checkpoints whose shapes stress the
split (grouped-query attention, fewer KV heads than ranks, a vocabulary that does not
divide by 2, o_proj bias, tied head), under every schedule; what cannot be split is refused
in one line before any weight loads; a worker that dies stops the engine.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig, ModelConfig
from pdserve.dist.comm import TPComm
from pdserve.dist.shard import TPShard, tp_refusal
from pdserve.engine import model_runner
from pdserve.engine.launch import PromptRows
from pdserve.engine.setup import EngineSetup, model_key
from pdserve.engine.tp import PlanDecoder, PlanEncoder, TPGroupBroken
from pdserve.model.arch import PRESETS, get_arch
from pdserve.model.loader import load_model
from pdserve.ops.reference import TorchAttentionBackend
from pdserve.request import Request
from pdserve.sched.base import Plan
from tests.engine.test_multiplex import SplitModel
from tests.engine.test_prompt_logprobs import TOP
from tests.engine.test_prompt_logprobs import _check_against as check_prompt_logprobs
from tests.engine.test_prompt_logprobs import _oracle as prompt_oracle
from tests.parallel.conftest import hf_greedy

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
CPU = torch.device("cpu")
OPTIONS = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 64, "chunk_size": 24}


def _prompts(vocab: int, count: int = 4, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]  # prefix-cache hits
    own = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(count)]
    return [(shared if i % 2 else []) + tokens for i, tokens in enumerate(own)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


# ---- the split itself (no processes) ----


def test_shard_layout_pads_the_vocabulary_and_replicates_kv_heads():
    arch = PRESETS["tiny"]  # 4 heads, 2 KV heads, vocabulary 320
    mqa = type(arch)(**{**arch.__dict__, "num_kv_heads": 1, "vocab_size": 301})
    last = TPShard(mqa, rank=1, size=2)
    assert (last.num_heads, last.num_kv_heads, last.kv_head_start) == (2, 1, 0)
    assert (last.vocab_per_rank, last.vocab_start, last.vocab_rows) == (151, 151, 150)
    assert last.slice_of("lm_head.weight") == (0, 151, 301, 301)
    assert last.slice_of("model.layers.0.self_attn.o_proj.weight")[:3] == (1, 128, 256)
    assert last.slice_of("model.layers.0.self_attn.o_proj.bias") is None  # added once
    four = TPShard(type(arch)(**{**arch.__dict__, "num_heads": 8}), rank=3, size=4)
    assert (four.num_kv_heads, four.kv_head_start) == (1, 1)  # query heads 6, 7 read KV head 1


def test_rank_one_loads_its_rows_and_columns(gqa_ckpt):
    """Rank 1 of 2, loaded in this process (loading needs no collective): each parameter is
    the slice of the checkpoint tensor the layout names, padding rows zero."""
    folder, hf = gqa_ckpt
    model_config = ModelConfig(model=folder, dtype="float32")
    arch = get_arch(model_config)
    shard = TPShard(arch, rank=1, size=2)
    ours = load_model(model_config, arch, "cpu", "float32", TorchAttentionBackend(), shard,
                      TPComm(rank=1, size=2))
    theirs, layer = hf.model.layers[0].self_attn, ours.model.layers[0].self_attn
    q, kv = ours.arch.q_size, ours.arch.kv_size  # this rank's: 2 heads, 1 KV head of 16
    assert torch.equal(layer.qkv_proj.weight[:q], theirs.q_proj.weight[32:64])
    assert torch.equal(layer.qkv_proj.weight[q:q + kv], theirs.k_proj.weight[16:32])
    assert torch.equal(layer.qkv_proj.bias[q + kv:], theirs.v_proj.bias[16:32])
    assert torch.equal(layer.o_proj.weight, theirs.o_proj.weight[:, 32:64])
    assert torch.equal(layer.o_proj.bias, theirs.o_proj.bias)  # whole: added once
    mlp = hf.model.layers[0].mlp
    assert torch.equal(ours.model.layers[0].mlp.down_proj.weight, mlp.down_proj.weight[:, 64:])
    assert torch.equal(ours.lm_head.weight[:150], hf.lm_head.weight[151:])
    assert not ours.lm_head.weight[150:].any(), "the padding row stays zero"


@pytest.mark.parametrize("size, words", [(3, "does not divide the model's 4 attention heads"),
                                         (0, "at least 1")])
def test_refusal_names_the_reason(size, words):
    assert words in tp_refusal(PRESETS["tiny"], size)


def test_heads_that_do_not_divide_are_refused_before_weights_load(tmp_path):
    # A checkpoint folder with a config but no weights: loading would fail on the missing
    # files, so the refusal proves it came first.
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), tensor_parallel_size=3)
    assert str(err.value) == "--tensor-parallel-size 3 does not divide the model's 4 " \
                             "attention heads"


# ---- two ranks ----


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["gqa_ckpt", "mqa_ckpt"])
def test_tp2_greedy_equals_tp1_and_transformers(request, ckpt):
    folder, hf = request.getfixturevalue(ckpt)
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert _generate(LLM(folder, **OPTIONS), prompts) == want
    with LLM(folder, tensor_parallel_size=2, **OPTIONS) as llm:
        assert _generate(llm, prompts) == want
        info = llm.engine.describe()
        assert info["tensor_parallel_size"] == 2
        assert info["overlap_schedule"]["off_because"] == \
            "not implemented under --tensor-parallel-size > 1"
    assert all(worker.poll() == 0 for worker in llm.engine.runner.tp.workers), "told to stop"


@pytest.mark.slow
def test_prompt_logprobs_under_tp2_equal_transformers(gqa_ckpt):
    """Workers score the prompt with rank 0 (their LM head's all-gathers must meet its
    own): prompts over several chunks, and a request that asks nothing in the same steps."""
    folder, hf = gqa_ckpt
    prompts = _prompts(hf.config.vocab_size, count=3)
    scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    with LLM(folder, tensor_parallel_size=2, **{**OPTIONS, "chunk_size": 7}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2],
                               [scored] * len(prompts) + [GREEDY] * len(prompts))
        llm.engine.check_integrity()
    for prompt, out in zip(prompts, outputs, strict=False):
        check_prompt_logprobs(prompt_oracle(hf, prompt), prompt, out.prompt_logprobs)
    assert all(out.prompt_logprobs is None for out in outputs[len(prompts):])


@pytest.mark.slow
def test_embeddings_under_tp2_equal_tp1(tiny_ckpt):
    """Rank 0 takes the rows (the hidden states are whole on every rank); the workers'
    mirrors never ask, and a generation in the same steps is unchanged."""
    prompts = _prompts(PRESETS["tiny"].vocab_size, count=3)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(tiny_ckpt, **OPTIONS) as llm:
        want = [out.outputs.embedding for out in llm.embed(inputs)]
    embedding = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True,
                               return_embedding=True)
    with LLM(tiny_ckpt, tensor_parallel_size=2, **OPTIONS) as llm:
        got = llm.generate(inputs * 2, [embedding] * 3 + [GREEDY] * 3)
        llm.engine.check_integrity()
    for out, vector in zip(got, want, strict=False):
        assert out.embedding == pytest.approx(vector, abs=1e-5)
    assert all(out.embedding is None for out in got[3:])
    assert [o.outputs[0].token_ids for o in got[:3]] == [o.outputs[0].token_ids
                                                          for o in got[3:]]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["prefill-first", "chunked", "multiplex", "disagg"])
def test_every_schedule_under_tp2_equals_tp1(tiny_ckpt, schedule, monkeypatch):
    prompts = _prompts(PRESETS["tiny"].vocab_size, count=6)
    # Few pages: preemption under the synchronous policies; disagg moves KV between pools.
    options = {**OPTIONS, "schedule": schedule, "num_blocks": 40 if schedule == "disagg" else 12,
               "disagg_prefill_kv_fraction": 0.5, "mux_sharing": "temporal,spatial"}
    want = _generate(LLM(tiny_ckpt, setup=_setup(schedule), **options), prompts)
    llm = LLM(tiny_ckpt, tensor_parallel_size=2, setup=_setup(schedule), **options)
    try:
        assert _generate(llm, prompts) == want
        llm.engine.check_integrity()
        stats = llm.engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        if schedule == "multiplex":
            spatial = [e for e in llm.engine.timeline() if e["mode"] == "spatial"]
            assert any(0 < e["prefill_layers"] < PRESETS["tiny"].num_layers for e in spatial)
        if schedule == "prefill-first":
            _check_worker_death_stops_the_engine(llm, prompts)
        if schedule == "chunked":
            _check_rank0_failure_stops_the_engine(llm, prompts, monkeypatch)
    finally:
        llm.close()


def _setup(schedule: str) -> EngineSetup | None:
    """Multiplex: latencies under which spatial sharing wins, so prefill runs as layer
    pieces beside decode steps on their own lanes (the CPU's measured times would not)."""
    return EngineSetup(predictor=SplitModel(PRESETS["tiny"].num_layers)) \
        if schedule == "multiplex" else None


class _FailingInputs:
    """Sampling inputs that cannot be built, on rank 0 only (the workers build none)."""

    @staticmethod
    def of(*args, **kwargs):
        raise RuntimeError("injected")


def _check_rank0_failure_stops_the_engine(llm: LLM, prompts, monkeypatch) -> None:
    # The worker has begun the launch and waits in its first all-reduce: going on would
    # pair every later collective with the wrong one.
    monkeypatch.setattr(model_runner, "SamplingInputs", _FailingInputs)
    with pytest.raises(TPGroupBroken, match="failed on rank 0 .*injected.* out of step"):
        _generate(llm, prompts[:1])


def _check_worker_death_stops_the_engine(llm: LLM, prompts: list[list[int]]) -> None:
    worker = llm.engine.runner.tp.workers[0]
    worker.kill()
    worker.wait()
    with pytest.raises(TPGroupBroken, match="rank 1 .* exited"):
        _generate(llm, prompts[:1])


def test_tp1_has_no_collectives():
    """One rank: the model is the plain one (no padding, no communicator)."""
    llm = LLM("tiny", dtype="float32")
    model = llm.engine.runner.model
    assert model.comm.size == 1 and model.lm_head.weight.shape[0] == PRESETS["tiny"].vocab_size
    assert llm.engine.describe()["tensor_parallel_size"] == 1
    assert torch.equal(model.embed(torch.tensor([5])), model.model.embed_tokens.weight[5:6])


def test_latency_profiles_are_kept_per_group_size():
    """A group of 2 times its own shard and all-reduces: it must not read the 1-GPU profile."""
    assert model_key(EngineConfig.from_flat(model="tiny")) == "tiny"
    assert model_key(EngineConfig.from_flat(model="tiny", tensor_parallel_size=2)) == "tiny-tp2"


def test_plan_sends_only_the_page_ids_a_worker_lacks():
    """Encoded on rank 0, decoded on a worker: the mirror's pages always equal the request's,
    though a decode step sends only pages added since, and a preemption or a new pool all."""
    encoder, decoder = PlanEncoder(), PlanDecoder()
    request = Request("a", list(range(10, 20)), GREEDY)
    request.block_ids = [4, 5]

    def travel(pool: str, num_new: int):
        plan = Plan()
        plan.add(request, num_new)
        sent = encoder.encode(plan, pool)
        item = decoder.decode(sent, pool).scheduled[0]
        assert item.request.block_ids == request.block_ids
        assert item.samples == plan.scheduled[0].samples
        start = request.num_computed
        assert item.request.token_ids[start:start + num_new] == \
            request.token_ids[start:start + num_new]
        return (sent[0] or sent[1])[0][6]  # the page ids that travelled

    assert travel("main", 10) == [4, 5]
    request.num_computed, request.block_ids = 10, request.block_ids + [6]
    request.append_token(7, None)
    assert travel("main", 1) == [6]
    request.num_preemptions, request.block_ids = 1, [9, 8, 3]  # re-admitted elsewhere
    assert travel("main", 1) == [9, 8, 3]
    assert travel("decode", 1) == [9, 8, 3]  # another pool's tables start empty
    encoder.forget("a")
    decoder.forget("a")
    assert not encoder.sent and not decoder.mirrors


def test_a_worker_scores_the_prompt_rows_rank_0_scores():
    """A scoring request's mirror gives the same prompt rows and targets as the request (its
    LM head then runs the same all-gathers); once the prompt is scored, neither scores."""
    encoder, decoder = PlanEncoder(), PlanDecoder()
    request = Request("s", list(range(10, 30)), SamplingParams(max_tokens=1, prompt_logprobs=2))
    request.block_ids, request.num_computed = [1, 2, 3], 8
    try:
        plan = Plan()
        plan.add(request, 7)
        mirrored = decoder.decode(encoder.encode(plan, "main"), "main")
        assert decoder.num_scoring == 1
        starts = np.array([0, 7])
        want, got = PromptRows.of(plan, starts, CPU), PromptRows.of(mirrored, starts, CPU)
        assert torch.equal(got.rows, want.rows) and torch.equal(got.targets, want.targets)
        assert (got.width, got.starts, got.counts) == (want.width, want.starts, want.counts)
    finally:
        request.take_prompt_logprobs()  # the process-wide count of scoring requests
    mirrored = decoder.decode(encoder.encode(plan, "main"), "main")
    assert decoder.num_scoring == 0 and not mirrored.scheduled[0].request.scores_prompt
