"""The fused rotary + KV-store kernel against the composition of the reference ops.

Tolerances: rotated q, k and the stored k within one unit in the last place of the dtype
(both sides rotate in fp32 and round once; a GPU may fuse multiply-adds); v is copied, so
it must match exactly; cache slots not in the slot mapping must stay untouched, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_env import interpreted

from pdserve.ops import reference

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
}
LONG_POSITIONS = (16_384, 20_000)  # past 16K: int64 offsets into the cos/sin table
PAGE_SIZE, NUM_PAGES = 16, 8


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    seed: int = 0

    def clone(self) -> Case:
        """A deep copy whose q, k, v are again views of one fused projection."""
        q_heads, kv_heads = self.q.shape[1], self.k.shape[1]
        return make_case(self.q.device, self.q.dtype, q_heads, kv_heads, self.q.shape[2],
                         self.cos_sin.shape[1], seed=self.seed, cache_dtype=self.k_cache.dtype)


def make_case(device, dtype, q_heads, kv_heads, head_dim, rot_dim, seed=0, tokens=11,
              cache_dtype=None) -> Case:
    """q, k, v as column views of one [T, (q + 2 kv) * d] projection, as the model makes them;
    tokens at positions past 16K; two padding tokens (slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(device=device, dtype=dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    positions = torch.randint(*LONG_POSITIONS, (tokens,), generator=gen)
    cos_sin = torch.randn(LONG_POSITIONS[1], rot_dim, generator=gen)
    cache_shape = (NUM_PAGES, PAGE_SIZE, kv_heads, head_dim)
    caches = [torch.randn(cache_shape, generator=gen) for _ in "kv"]
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    return Case(q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim),
                v.view(tokens, kv_heads, head_dim), positions.to(device), cos_sin.to(device),
                *(c.to(device=device, dtype=cache_dtype or dtype) for c in caches),
                slots.to(device), seed=seed)


def _run(impl, case: Case) -> None:
    impl.rope_store_kv(case.q, case.k, case.v, case.positions, case.cos_sin, case.k_cache,
                       case.v_cache, case.slots)


def check_against_reference(impl, case: Case) -> None:
    ours, ref, before = case, case.clone(), case.clone()
    assert not ours.q.is_contiguous(), "the case must exercise strided q/k/v views"
    _run(impl, ours)
    _run(reference, ref)
    tol = TOL[ours.q.dtype]
    torch.testing.assert_close(ours.q, ref.q, **tol)
    torch.testing.assert_close(ours.k, ref.k, **tol)
    torch.testing.assert_close(ours.v, before.v, atol=0, rtol=0)
    written = ours.slots[ours.slots >= 0]
    pages, offsets = written // PAGE_SIZE, written % PAGE_SIZE
    torch.testing.assert_close(ours.k_cache[pages, offsets], ref.k_cache[pages, offsets], **tol)
    torch.testing.assert_close(ours.v_cache[pages, offsets], ref.v_cache[pages, offsets],
                               atol=0, rtol=0)
    _assert_untouched(ours, before, pages, offsets)


def _assert_untouched(after: Case, before: Case, pages, offsets) -> None:
    """Every slot outside the mapping (padding tokens' included) keeps its old contents."""
    keep = torch.ones(NUM_PAGES, PAGE_SIZE, dtype=torch.bool, device=pages.device)
    keep[pages, offsets] = False
    assert keep.sum() == NUM_PAGES * PAGE_SIZE - pages.numel()
    for new, old in ((after.k_cache, before.k_cache), (after.v_cache, before.v_cache)):
        torch.testing.assert_close(new[keep], old[keep], atol=0, rtol=0)


def _fused():
    from pdserve.ops import triton_fused

    return triton_fused


def test_reference_is_rope_then_store():
    """The reference rotates in place exactly as apply_rope does and stores the result."""
    case = make_case("cpu", torch.float32, 6, 2, 32, 32)
    q_rot, k_rot = reference.apply_rope(case.q, case.k, case.positions, case.cos_sin)
    _run(reference, case)
    assert torch.equal(case.q, q_rot) and torch.equal(case.k, k_rot)
    valid = case.slots >= 0
    slots = case.slots[valid]
    assert torch.equal(case.k_cache[slots // PAGE_SIZE, slots % PAGE_SIZE], k_rot[valid])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, rot_dim",
                         [(6, 2, 32, 32), (4, 4, 16, 16), (8, 2, 32, 16), (12, 3, 24, 24)])
def test_rope_store_kv_interpreted(dtype, q_heads, kv_heads, head_dim, rot_dim):
    check_against_reference(_fused(), make_case("cpu", dtype, q_heads, kv_heads, head_dim,
                                                 rot_dim, seed=head_dim))


@interpreted
def test_rope_store_kv_rejects_strided_head_dim():
    case = make_case("cpu", torch.float32, 4, 2, 16, 16)
    case.q = case.q.transpose(0, 2).contiguous().transpose(0, 2)
    with pytest.raises(ValueError, match="unit head_dim stride"):
        _run(_fused(), case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim, rot_dim",
                         [(32, 8, 128, 128), (64, 8, 128, 128), (28, 4, 128, 128),
                          (12, 4, 64, 64), (16, 2, 128, 64)])
def test_rope_store_kv_gpu(dtype, q_heads, kv_heads, head_dim, rot_dim):
    check_against_reference(_fused(), make_case("cuda", dtype, q_heads, kv_heads, head_dim,
                                                rot_dim, seed=q_heads))
