"""Steps with prompt tokens as graph segments between the attentions (``piecewise.py``)."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.piecewise import PiecewiseGraphs, token_buckets
from pdserve.sched.base import MAIN_POOL
from tests.engine.conftest import hf_greedy

MAX_NEW = 8


def test_every_step_size_up_to_the_largest_has_a_bucket():
    for max_tokens in range(1, 3000):
        buckets = token_buckets(max_tokens)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
        assert buckets[0] == min(16, max_tokens)
        gaps = [b - a for a, b in zip([0, *buckets], buckets, strict=False)]
        assert max(gaps) <= 16  # padding never more than one stride


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 90))] for _ in range(count)]


class CountingSegments(PiecewiseGraphs):
    """The segments run without graphs (CPU), counting the steps that went through them."""

    steps = 0

    def run(self, batch, meta, sampled=None):
        CountingSegments.steps += 1
        return super().run(batch, meta, sampled)


def _with_segments(llm: LLM, max_tokens: int, capture: bool, cls=PiecewiseGraphs):
    runner = llm.engine.runner
    pool = runner.pools[MAIN_POOL]
    pool.piecewise = cls(runner.model, pool.kv_caches, max_tokens, runner.device,
                         capture=capture)
    if capture:
        pool.piecewise.capture()
    return pool.piecewise


@pytest.mark.parametrize("schedule", [dict(schedule="chunked", chunk_size=13),
                                      dict(schedule="prefill-first")])
def test_segmented_steps_match_transformers(hf_llama, schedule):
    """Mixed steps (decodes plus chunks, padded to a bucket) and whole prompts run through
    the segments give transformers' greedy tokens."""
    folder, model = hf_llama
    prompts = _prompts(6)
    llm = LLM(folder, dtype="float32", **schedule)
    CountingSegments.steps = 0
    _with_segments(llm, 512, capture=False, cls=CountingSegments)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == \
        [hf_greedy(model, p, MAX_NEW) for p in prompts]
    assert CountingSegments.steps > 0
    llm.engine.check_integrity()


def test_a_step_past_the_largest_bucket_runs_eagerly(hf_llama):
    folder, _ = hf_llama
    llm = LLM(folder, dtype="float32", schedule="prefill-first")
    CountingSegments.steps = 0
    _with_segments(llm, 16, capture=False, cls=CountingSegments)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], params)
    assert CountingSegments.steps == 0  # 37 prompt tokens > 16: the eager forward ran


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [dict(schedule="chunked", chunk_size=64),
                                      dict(schedule="prefill-first")])
def test_captured_segments_match_transformers_on_gpu(hf_llama_gpu, schedule):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    folder, model = hf_llama_gpu
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 300))]
               for _ in range(6)]
    llm = LLM(folder, dtype="float32", device="cuda", **schedule)
    segments = llm.engine.runner.pools[MAIN_POOL].piecewise
    assert segments is not None and segments.graphs, "captured at start-up on a GPU"
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = [hf_greedy(model.cpu(), p, MAX_NEW) for p in prompts]
    model.cuda()
    assert [o.outputs[0].token_ids for o in outputs] == want
