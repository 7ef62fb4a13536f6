"""The engine's greedy tokens equal transformers' under every batching and caching path."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from tests.engine.conftest import hf_greedy

MAX_NEW = 12


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(40)]  # a common prefix for cache hits
    prompts = []
    for i in range(count):
        own = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 60))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


@pytest.fixture(scope="module")
def expected(hf_llama):
    _, model = hf_llama
    prompts = _prompts(8)
    return prompts, [hf_greedy(model, p, MAX_NEW) for p in prompts]


CONFIGS = {
    "prefill-first": dict(schedule="prefill-first"),
    "chunked-7": dict(schedule="chunked", chunk_size=7),
    "chunked-64": dict(schedule="chunked", chunk_size=64),
    "no-prefix-cache": dict(schedule="chunked", chunk_size=32, enable_prefix_caching=False),
    # 10 blocks of 8 tokens cannot hold 8 requests of up to 112 tokens: forces preemption.
    "preempting": dict(schedule="chunked", chunk_size=32, num_blocks=24, block_size=8),
    "prefill-first-preempting": dict(schedule="prefill-first", num_blocks=24, block_size=8,
                                     max_num_batched_tokens=64),
    # Overlap scheduling is on in all the others (their default).
    "chunked-7-synchronous": dict(schedule="chunked", chunk_size=7, overlap_schedule=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(hf_llama, expected, name):
    folder, _ = hf_llama
    prompts, want = expected
    llm = LLM(folder, dtype="float32", **CONFIGS[name])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == want
    llm.engine.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    stats = llm.engine.stats()
    if name == "chunked-64":
        assert stats.prefix_cache_hits > 0, "odd prompts share a 40-token prefix"
    if name.endswith("preempting"):
        assert stats.num_preemptions > 0
    overlapped = llm.engine.describe()["overlap_schedule"]["overlapped_steps"]
    assert (overlapped > 0) == (name != "chunked-7-synchronous")


def test_prefix_hit_reuses_blocks_and_matches(hf_llama):
    folder, model = hf_llama
    llm = LLM(folder, dtype="float32", block_size=8)
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0]
    second = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert second.num_cached_tokens == 56  # 7 full blocks; the last token is recomputed
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == hf_greedy(model, prompt, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["prefill-first", "chunked-64", "preempting"])
def test_triton_engine_matches_transformers_on_gpu(hf_llama_gpu, name):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    folder, model = hf_llama_gpu
    rng = random.Random(1)
    shared = [rng.randrange(3, 1000) for _ in range(300)]
    own = [[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 700))] for _ in range(12)]
    prompts = [(shared if i % 2 else []) + tokens for i, tokens in enumerate(own)]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 min_new_tokens=MAX_NEW)
        want.append(out[0, len(prompt):].tolist())
    options = dict(CONFIGS[name], num_blocks=4096)  # a fixed pool, not a share of the GPU
    if name == "preempting":
        options.update(num_blocks=120, block_size=16)
    llm = LLM(folder, dtype="float32", device="cuda", attention_backend="triton", **options)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in
           llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    llm.engine.check_integrity()
