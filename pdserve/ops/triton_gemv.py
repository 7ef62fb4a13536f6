"""Triton GEMVs for decode batches of a few rows, with the small ops around them fused in.

A decode step at batch 1 reads every weight once and does almost no arithmetic, so the
projections are pure streaming; what the step loses is the fixed cost of the kernels
between them (norms, SiLU, residual adds, cuBLAS split-K reductions). Each kernel here
computes ``out[m, n] = sum_k W[n, k] * f(x[m, k])`` for M <= ``MAX_ROWS`` rows: one program
owns ``BLOCK_N`` weight rows and sweeps the whole K (no split-K, so no reduction kernel),
and

- ``rms_norm_gemv``: f is x times the norm weight; the same sweep sums x^2 and the dot
  products are scaled by rsqrt(mean + eps) at the end, so the RMSNorm kernel goes;
- ``gemv_add``: the epilogue adds the residual stream (o_proj, down_proj);
- ``silu_mul_gemv_add``: x is the gate/up projection ``[gate | up]``; f is silu(gate) * up
  (rounded to the activation dtype as ``silu_and_mul`` does), so the SiLU kernel goes.

The tiles come from ``GEMV_CONFIGS`` (weight shape and row bucket) or ``default_config``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.ops.dispatch import GEMV_MAX_ROWS as MAX_ROWS

_PLAIN, _RMS_NORM, _SILU_MUL = 0, 1, 2


@dataclass(frozen=True)
class GemvConfig:
    """One launch's tiles. ``use_dot``: tensor-core ``tl.dot`` on rows padded to 16 (the
    x tile is read once per 16 rows of it); otherwise a broadcast multiply and a sum over
    K, cheapest for one or two rows."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False


# Measured configs by (N, K, row bucket); the row bucket is M rounded up to 1, 2, 4 or 8.
# Empty until a GPU sweep (benchmarks/bench_gemv.py) fills it; misses use default_config.
# The fastest config of benchmarks/bench_gemv.py's sweep per codellama-34b shape on the H200
# (benchmarks/results/gemv_h200_codellama34b_2c05d54.json); even these run at 0.42-1.00x of
# cuBLAS, which is why the path is off by default.
GEMV_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (10240, 8192, 1): GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False),
    (10240, 8192, 2): GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False),
    (10240, 8192, 4): GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False),
    (10240, 8192, 8): GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True),
    (8192, 8192, 1): GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, use_dot=True),
    (8192, 8192, 2): GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, use_dot=True),
    (8192, 8192, 4): GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, use_dot=True),
    (8192, 8192, 8): GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4, use_dot=True),
    (44032, 8192, 1): GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False),
    (44032, 8192, 2): GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False),
    (44032, 8192, 4): GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=3, use_dot=False),
    (44032, 8192, 8): GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True),
    (8192, 22016, 1): GemvConfig(block_n=8, block_k=1024, num_warps=8, num_stages=4, use_dot=False),
    (8192, 22016, 2): GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, use_dot=False),
    (8192, 22016, 4): GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3, use_dot=False),
    (8192, 22016, 8): GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, use_dot=True),
}


def row_bucket(rows: int) -> int:
    return triton.next_power_of_2(max(rows, 1))


def default_config(rows: int) -> GemvConfig:
    """Hopper starting points, before a sweep: 16-byte loads along K (8 bf16 values per
    thread), at most 32 fp32 partial sums per thread in the broadcast form (ptxas for sm_90:
    94-116 registers at one row, 128-155 at two, by prologue; no spills); four rows and up
    use tensor cores (48-128 registers, no spills)."""
    if row_bucket(rows) <= 2:
        return GemvConfig(block_n=8, block_k=512)
    return GemvConfig(block_n=16, block_k=256, num_stages=4, use_dot=True)


def config_for(rows: int, n: int, k: int) -> GemvConfig:
    return GEMV_CONFIGS.get((n, k, row_bucket(rows))) or default_config(rows)


@triton.jit
def _activation_tile(x_ptr, norm_w_ptr, offs_m, m_mask, offs_k, k_mask, stride_xm, K,
                     PROLOGUE: tl.constexpr, OUT_TY: tl.constexpr, BLOCK_M: tl.constexpr):
    """f(x) for one [BLOCK_M, BLOCK_K] tile in fp32, and its rows' sum of x^2 (for the
    RMSNorm prologue; zeros otherwise)."""
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x_mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:  # RMSNorm: x^2 summed on the way, the scale applied at the end
        sum_sq = tl.sum(x * x, 1)
        x = x * tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    if PROLOGUE == 2:  # SiLU-and-mul: gate in the first K columns, up in the next K
        up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
        x = (x * tl.sigmoid(x) * up).to(OUT_TY).to(tl.float32)
    return x, sum_sq


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, norm_w_ptr, residual_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: BLOCK_N weight rows against all M rows of x, over the whole K."""
    out_ty = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            offs_k = k_start + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x, tile_sq = _activation_tile(x_ptr, norm_w_ptr, offs_m, m_mask, offs_k, k_mask,
                                          stride_xm, K, PROLOGUE, out_ty, BLOCK_M)
            sum_sq += tile_sq
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)
            acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision=DOT_PRECISION)
    else:
        # The weight tile is loaded as [1, BLOCK_N, BLOCK_K], in the layout of the products
        # (no shuffle of it through shared memory), one tile ahead of its use (the loads of
        # tile i + 1 are in flight while tile i is multiplied; past K they are masked off),
        # and the products are summed along K once, after the loop.
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        w_tiles = w_rows[None, :, :] + tl.arange(0, BLOCK_K)[None, None, :]
        w_mask_n = n_mask[None, :, None]
        w_next = tl.load(w_tiles, mask=w_mask_n & (tl.arange(0, BLOCK_K) < K)[None, None, :],
                         other=0.0)
        for k_start in range(0, K, BLOCK_K):
            offs_k = k_start + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            w = w_next
            w_next = tl.load(w_tiles + k_start + BLOCK_K,
                             mask=w_mask_n & (offs_k + BLOCK_K < K)[None, None, :], other=0.0)
            x, tile_sq = _activation_tile(x_ptr, norm_w_ptr, offs_m, m_mask, offs_k, k_mask,
                                          stride_xm, K, PROLOGUE, out_ty, BLOCK_M)
            sum_sq += tile_sq
            acc3 += x[:, None, :] * w.to(tl.float32)
        acc = tl.sum(acc3, 2)
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(sum_sq / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
        acc += tl.load(r_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ty), mask=out_mask)


def rms_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(rms_norm(x, norm_weight, eps), weight, bias)`` in one launch."""
    return _gemv(x, weight, bias, _RMS_NORM, x.shape[-1], norm_weight=norm_weight, eps=eps,
                 config=config)


def gemv_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """``residual + F.linear(x, weight, bias)`` in one launch: the new residual stream."""
    return _gemv(x, weight, bias, _PLAIN, x.shape[-1], residual=residual, config=config)


def silu_mul_gemv_add(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor, config: GemvConfig | None = None
                      ) -> torch.Tensor:
    """``residual + F.linear(silu_and_mul(gate_up), weight, bias)`` in one launch."""
    return _gemv(gate_up, weight, bias, _SILU_MUL, gate_up.shape[-1] // 2, residual=residual,
                 config=config)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
          k: int, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
          residual: torch.Tensor | None = None, config: GemvConfig | None = None
          ) -> torch.Tensor:
    _check_gemv_shapes(x, weight, k, residual)
    rows, n = x.shape[0], weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    config = config or config_for(rows, n, k)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight,
        norm_weight if norm_weight is not None else weight,
        residual if residual is not None else out, out,
        rows, n, k, x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        USE_DOT=config.use_dot,
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        BLOCK_M=16 if config.use_dot else row_bucket(rows),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def _check_gemv_shapes(x: torch.Tensor, weight: torch.Tensor, k: int,
                       residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"GEMV takes [rows <= {MAX_ROWS}, K] activations, got "
                         f"{tuple(x.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("GEMV needs a unit stride along K in x and the weight")
    if weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} does not take K = {k}")
    if residual is not None and residual.shape != (x.shape[0], weight.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)} is not "
                         f"{(x.shape[0], weight.shape[0])}")
    if residual is not None and residual.stride(-1) != 1:
        raise ValueError("GEMV needs a unit inner stride in the residual")
