"""The Triton row argmax (greedy token, Gumbel-max draw) against ``reference.row_argmax``."""

from __future__ import annotations

import pytest
import torch
from kernel_env import interpreted

from pdserve.engine.sampler import SamplingBatch, sample
from pdserve.ops import dispatch, reference
from pdserve.ops.launch_count import count_launches
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams


def _sampling():
    from pdserve.ops import triton_sampling

    return triton_sampling


def _logits(rows: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * 3).to(device)


def _check_greedy(device: str, vocab: int, block: int | None) -> None:
    logits = _logits(4, vocab, vocab, device)
    # Ties across chunk edges and inside one chunk: the first index wins, as in torch (the
    # interpreter's argmax always takes the first; the GPU test checks the compiled one).
    logits[0, [5, block or 70, vocab - 1]] = 100.0
    logits[1, [vocab - 2, vocab - 1]] = 100.0
    logits[2] = float("-inf")  # every token filtered out: torch answers 0
    logits[3, 7] = float("nan")  # torch takes NaN as the largest value
    ours = _sampling().row_argmax(logits, None, block)
    assert ours.dtype == torch.int64
    assert ours.tolist() == reference.row_argmax(logits).tolist() == [5, vocab - 2, 0, 7]


def _check_draw(device: str, vocab: int, block: int | None) -> None:
    logits = _logits(4, vocab, vocab + 1, device)
    logits[1, ::3] = float("-inf")  # filtered tokens: never drawn, even under noise 0
    noise = torch.empty(4, vocab).exponential_(generator=torch.Generator().manual_seed(2))
    noise[1, ::6] = 0.0
    noise = noise.to(device)
    ours = _sampling().row_argmax(logits, noise, block).cpu()
    keys = torch.where(logits == float("-inf"), logits, logits - noise.log()).cpu()
    # log differs between Triton and torch in the last place: the drawn token's key must be
    # the row's largest to that precision, rather than the very same index.
    chosen = keys.gather(1, ours[:, None]).squeeze(1)
    torch.testing.assert_close(chosen, keys.max(-1).values, atol=1e-5, rtol=1e-6)
    reference_chosen = keys.gather(1, reference.row_argmax(logits, noise).cpu()[:, None])
    torch.testing.assert_close(reference_chosen.squeeze(1), chosen, atol=1e-5, rtol=1e-6)


@interpreted
@pytest.mark.parametrize("vocab", [1, 63, 64, 200, 1000])
def test_row_argmax_interpreted(vocab):
    if vocab < 100:  # the tie pattern needs room for its columns
        logits = _logits(2, vocab, vocab, "cpu")
        assert _sampling().row_argmax(logits).tolist() == logits.argmax(-1).tolist()
        return
    _check_greedy("cpu", vocab, None)
    _check_draw("cpu", vocab, None)


@interpreted
def test_row_argmax_refuses_bad_shapes():
    f = _sampling()
    with pytest.raises(ValueError, match="rows, vocab"):
        f.row_argmax(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="noise"):
        f.row_argmax(torch.zeros(2, 8), torch.ones(2, 7))
    with pytest.raises(ValueError, match="no columns"):
        f.row_argmax(torch.zeros(2, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256])
def test_row_argmax_gpu(vocab):
    _check_greedy("cuda", vocab, None)
    _check_draw("cuda", vocab, None)


def _sampling_batch(params: list[SamplingParams], vocab: int) -> SamplingBatch:
    requests = [Request(f"r{i}", [1, 2], p) for i, p in enumerate(params)]
    for i, request in enumerate(requests):
        request.generator = torch.Generator().manual_seed(10 + i)  # seeded: same noise twice
    return SamplingBatch.from_requests(requests, vocab, "cpu")


SAMPLED = SamplingParams(temperature=0.7)
FILTERED = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.01)
GREEDY = SamplingParams(temperature=0)


@interpreted
@pytest.mark.parametrize("rows", [[GREEDY, GREEDY], [SAMPLED, FILTERED], [GREEDY, SAMPLED]])
def test_sampler_on_the_triton_argmax_draws_the_reference_tokens(rows, monkeypatch):
    logits = _logits(len(rows), 500, 7, "cpu")
    want = sample(logits, _sampling_batch(rows, 500))[0]
    monkeypatch.setenv(dispatch.TRITON_ARGMAX_ENV, "1")
    with dispatch.interpreted_triton_ops(), count_launches() as count:
        got = sample(logits, _sampling_batch(rows, 500))[0]
    assert got.tolist() == want.tolist()
    # One argmax (two launches) per step: the greedy one only where a row is greedy.
    argmaxes = 2 if GREEDY in rows and SAMPLED in rows else 1
    assert count.by_name["triton::_chunk_argmax_kernel"] == argmaxes
    assert count.by_name["triton::_pick_chunk_kernel"] == argmaxes
    assert count.by_name["aten::argmax"] == 0
    # Only top-p needs probabilities (the mass of the sorted tokens); the draw needs none.
    assert count.by_name["aten::_softmax"] == (1 if FILTERED in rows else 0)


@interpreted
def test_the_triton_argmax_is_opt_in(monkeypatch):
    monkeypatch.delenv(dispatch.TRITON_ARGMAX_ENV, raising=False)
    logits = _logits(2, 500, 7, "cpu")
    with dispatch.interpreted_triton_ops(), count_launches() as count:
        sample(logits, _sampling_batch([GREEDY, SAMPLED], 500))
    assert count.by_name["triton::_chunk_argmax_kernel"] == 0
    assert count.by_name["aten::argmax"] == 2
