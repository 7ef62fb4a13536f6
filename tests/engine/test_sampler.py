from __future__ import annotations

import torch

from pdserve.engine.sampler import SamplingBatch, sample
from pdserve.sampling_params import SamplingParams
from tests.engine.factories import make_request


def _batch(params: list[SamplingParams], vocab: int) -> SamplingBatch:
    requests = [make_request(1) for _ in params]
    for request, p in zip(requests, params, strict=True):
        request.params = p
        request.generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    return SamplingBatch.from_requests(requests, vocab, "cpu")


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.randn(3, 50)
    greedy = SamplingParams(temperature=0, logprobs=True)
    tokens, logprobs = sample(logits, _batch([greedy] * 3, 50))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    want = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, want)


def test_top_k_one_and_tiny_top_p_pick_the_top_token():
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)]
    tokens, _ = sample(logits, _batch(params, 50))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_never_draws_outside_the_k_best():
    logits = torch.randn(1, 30)
    allowed = set(logits.topk(3).indices[0].tolist())
    batch = _batch([SamplingParams(temperature=5.0, top_k=3)], 30)
    drawn = {sample(logits, batch)[0].item() for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, 100)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[:1], _batch([seeded], 100))[0].item() for _ in range(1)]
    mixed = sample(logits, _batch([seeded, SamplingParams(), SamplingParams(seed=9)], 100))[0]
    assert mixed[0].item() == alone[0]


def test_draws_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    batch = _batch([SamplingParams(temperature=1.0)], 4)
    torch.manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(probs.log(), batch)[0].item()] += 1
    # 4000 draws: the standard error of each share is below 0.008; 0.03 is ~4 sigma.
    assert torch.allclose(counts / 4000, probs[0], atol=0.03)


def test_worst_case_sampling_runs_every_filter():
    from pdserve.engine.sampler import worst_case_sampling

    logits = torch.randn(4, 300)
    tokens, logprobs = sample(logits, worst_case_sampling(4, "cpu"))
    top50 = logits.topk(50).indices
    assert all(t in top50[i] for i, t in enumerate(tokens.tolist()))
    assert logprobs is not None and logprobs.shape == (4,)
