"""The fused decode GEMVs (Triton) against their torch references, every row count up to
``GEMV_MAX_ROWS``, odd K and N, both inner-product forms (broadcast sum and ``tl.dot``).

Tolerance: the kernel and the reference both compute in fp32 and round once; they differ
in summation order (and, for ``tl.dot`` in bf16, in rounding x to bf16 before the product),
so fp32 allows 1e-4, and bf16 allows 1% of the largest output (one to two units in the
last place at that magnitude: an output near zero after cancellation inherits the rounding
error of the large products it summed).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import interpreted

from pdserve.ops import reference
from pdserve.ops.dispatch import GEMV_MAX_ROWS

N, K = 37, 83  # odd on purpose: partial tiles along both weight dimensions


def _gemv():
    from pdserve.ops import triton_gemv

    return triton_gemv


def _inputs(rows: int, dtype: torch.dtype, seed: int, device: str = "cpu"
            ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return {"x": rand(rows, K, scale=3.0), "gate_up": rand(rows, 2 * K), "weight": rand(N, K),
            "bias": rand(N), "norm_weight": rand(K, scale=0.5) + 1, "residual": rand(rows, N)}


def _cases(t: dict[str, torch.Tensor], bias: torch.Tensor | None, config):
    """(name, kernel call, reference call) for the three fused GEMVs."""
    g = _gemv()
    x, w, r, nw, gu = t["x"], t["weight"], t["residual"], t["norm_weight"], t["gate_up"]
    return [
        ("rms_norm_gemv", lambda: g.rms_norm_gemv(x, nw, 1e-5, w, bias, config=config),
         lambda: reference.rms_norm_gemv(x, nw, 1e-5, w, bias)),
        ("gemv_add", lambda: g.gemv_add(x, w, bias, r, config=config),
         lambda: reference.gemv_add(x, w, bias, r)),
        ("silu_mul_gemv_add", lambda: g.silu_mul_gemv_add(gu, w, bias, r, config=config),
         lambda: reference.silu_mul_gemv_add(gu, w, bias, r)),
    ]  # fmt: skip


def _configs():
    g = _gemv()
    return {"broadcast": g.GemvConfig(block_n=8, block_k=32),
            "dot": g.GemvConfig(block_n=16, block_k=32, use_dot=True), "default": None}


def _tolerance(ref: torch.Tensor) -> dict[str, float]:
    if ref.dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-4)
    return dict(atol=1e-2 * ref.float().abs().max().item(), rtol=2e-2)


def _check_all(rows: int, dtype: torch.dtype, form: str, device: str = "cpu") -> None:
    t = _inputs(rows, dtype, seed=rows, device=device)
    for with_bias in (False, True):
        for name, run, run_ref in _cases(t, t["bias"] if with_bias else None, _configs()[form]):
            out, ref = run(), run_ref()
            assert out.shape == ref.shape == (rows, N) and out.dtype == dtype
            torch.testing.assert_close(out, ref, **_tolerance(ref),
                                       msg=lambda m, n=name, b=with_bias: f"{n} bias={b}: {m}")


@interpreted
@pytest.mark.parametrize("form", ["broadcast", "dot", "default"])
@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
def test_gemv_matches_reference_fp32(rows, form):
    _check_all(rows, torch.float32, form)


@interpreted
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_matches_reference_bf16(rows):
    """The broadcast form only: Triton 3.6's interpreter returns garbage for ``tl.dot`` on
    bf16 operands (any kernel, not this one), so the bf16 dot form is checked on a GPU."""
    _check_all(rows, torch.bfloat16, "broadcast")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["broadcast", "dot", "default"])
@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference_gpu(rows, form, dtype):
    _check_all(rows, dtype, form, device="cuda")


@interpreted
def test_gemv_refuses_more_rows_than_it_serves():
    t = _inputs(GEMV_MAX_ROWS + 1, torch.float32, seed=0)
    with pytest.raises(ValueError, match="rows <= 8"):
        _gemv().gemv_add(t["x"], t["weight"], None, t["residual"])


@interpreted
def test_gemv_refuses_a_residual_of_the_wrong_shape():
    t = _inputs(2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="residual"):
        _gemv().gemv_add(t["x"], t["weight"], None, t["residual"][:, :-1])
