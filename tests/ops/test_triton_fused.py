"""Triton fused small ops vs their torch references on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from kernel_env import interpreted

from pdserve.ops import reference

INTERP_TOL = dict(atol=1e-5, rtol=1e-5)
# Both sides compute in fp32 and round once; allow one unit in the last place.
GPU_TOL = {torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2), torch.float16: dict(atol=1e-3, rtol=2e-3)}


def _fused():
    from pdserve.ops import triton_fused

    return triton_fused


def _cases(device: str, dtype: torch.dtype, hidden: int, heads: tuple[int, int], head_dim: int):
    """(name, triton callable, reference callable) over shared random inputs."""
    gen = torch.Generator().manual_seed(hidden + head_dim)

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    x, res, w = rand(2, 3, hidden), rand(2, 3, hidden), rand(hidden)
    gate_up = rand(5, 2 * (hidden + 8))
    tokens, (q_heads, kv_heads) = 7, heads
    # q and k as column views of one fused projection: strided rows, as the model has them.
    qkv = rand(tokens, (q_heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(
        tokens, kv_heads, head_dim
    )
    positions = torch.randint(0, 50, (tokens,), generator=gen).to(device)
    full_rope = rand(64, head_dim, dt=torch.float32)
    partial_rope = rand(64, head_dim // 2, dt=torch.float32)
    f = _fused()
    return [
        ("rms_norm", lambda: f.rms_norm(x, w, 1e-6), lambda: reference.rms_norm(x, w, 1e-6)),
        (
            "fused_add_rms_norm",
            lambda: f.fused_add_rms_norm(x, res, w, 1e-5),
            lambda: reference.fused_add_rms_norm(x, res, w, 1e-5),
        ),
        ("silu_and_mul", lambda: f.silu_and_mul(gate_up), lambda: reference.silu_and_mul(gate_up)),
        (
            "rope",
            lambda: f.apply_rope(q, k, positions, full_rope),
            lambda: reference.apply_rope(q, k, positions, full_rope),
        ),
        (
            "rope_partial",
            lambda: f.apply_rope(q, k, positions, partial_rope),
            lambda: reference.apply_rope(q, k, positions, partial_rope),
        ),
    ]


def _assert_same(out, ref, tol: dict) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, **tol)


@interpreted
def test_fused_ops_interpreted():
    for name, run, run_ref in _cases("cpu", torch.float32, 40, (4, 2), 16):
        try:
            _assert_same(run(), run_ref(), INTERP_TOL)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err


@interpreted
def test_store_kv_interpreted():
    _check_store_kv("cpu", torch.float32, page_size=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden, heads, head_dim", [(4096, (32, 8), 128), (8192, (64, 8), 128),
                                                     (1000, (12, 4), 64)])  # fmt: skip
def test_fused_ops_gpu(dtype, hidden, heads, head_dim):
    for name, run, run_ref in _cases("cuda", dtype, hidden, heads, head_dim):
        try:
            _assert_same(run(), run_ref(), GPU_TOL[dtype])
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_gpu(dtype):
    _check_store_kv("cuda", dtype, page_size=16, kv_heads=8, head_dim=128)


def _check_store_kv(device, dtype, page_size, kv_heads=2, head_dim=16):
    gen = torch.Generator().manual_seed(page_size)
    num_pages, tokens = 6, 9
    cache = [torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen) for _ in "kv"]
    cache = [c.to(device=device, dtype=dtype) for c in cache]
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots[[1, 4]] = -1  # padding tokens
    slots = slots.to(device)
    ours = [c.clone() for c in cache]
    _fused().store_kv(k, v, *ours, slots)
    reference.store_kv(k, v, *cache, slots)
    for o, r in zip(ours, cache, strict=True):
        torch.testing.assert_close(o, r, atol=0, rtol=0)
