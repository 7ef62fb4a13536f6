"""Triton versions of the small per-token ops in ``reference.py``, same semantics.

Each is one kernel launch with fp32 math inside, where the reference takes several torch
ops and round trips through memory. ``store_kv`` also avoids the reference's boolean
indexing, which syncs with the host and so cannot be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.ops.pdl import launch_options, uses_pdl

try:  # Triton 3.4 and later; named only under a kernel's PDL constexpr
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # PDL then stays off (ops/pdl.py: grid_dependency_control)
    gdc_launch_dependents = gdc_wait = None

# --------------------------------------------------------------------------- norms


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # launched early: nothing is read before the step before has finished
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # The reference rounds the sum to the activation dtype before normalising it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(summed_ptr + row * stride_s + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x32 * inv_rms * w).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2d = _rows(x)
    out = torch.empty_like(x2d)
    _launch_norm(x2d, None, weight, out, None, eps)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is the next residual."""
    x2d, r2d = _rows(x), _rows(residual)
    out, summed = torch.empty_like(x2d), torch.empty_like(x2d)
    _launch_norm(x2d, r2d, weight, out, summed, eps)
    return out.view(x.shape), summed.view(x.shape)


def _launch_norm(x, residual, weight, out, summed, eps: float) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    pdl = uses_pdl(x)
    _rms_norm_kernel[(rows,)](
        x,
        residual if has_residual else x,
        weight,
        out,
        summed if has_residual else out,
        x.stride(0),
        residual.stride(0) if has_residual else 0,
        out.stride(0),
        summed.stride(0) if has_residual else 0,
        hidden,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        PDL=pdl,
        num_warps=_row_warps(block),
        **launch_options(pdl),
    )


# --------------------------------------------------------------------------- activation


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    x2d = _rows(gate_up)
    rows, inter = x2d.shape[0], x2d.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (rows, triton.cdiv(inter, block))
        pdl = uses_pdl(x2d)
        _silu_and_mul_kernel[grid](
            x2d, out, x2d.stride(0), out.stride(0), inter, BLOCK=block, PDL=pdl, num_warps=4,
            **launch_options(pdl),
        )
    return out.view(*gate_up.shape[:-1], inter)


# --------------------------------------------------------------------------- rotary


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cs,
    num_heads,
    head_dim,
    HALF_ROT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """One program = one token x BLOCK_H heads; neox layout (rotate halves of rot_dim)."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    rot_mask = offs < HALF_ROT
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=rot_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF_ROT + offs, mask=rot_mask, other=0.0)
    mask = head_mask[:, None] & rot_mask[None, :]
    x_row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    o_row = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(x_row + offs[None, :], mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF_ROT + offs[None, :], mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(o_row + offs[None, :], (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype),
             mask=mask)  # fmt: skip
    tl.store(o_row + HALF_ROT + offs[None, :],
             (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)  # fmt: skip
    if BLOCK_PASS > 0:  # partial rotary: channels past rot_dim pass through unchanged
        offs_p = 2 * HALF_ROT + tl.arange(0, BLOCK_PASS)
        pass_mask = head_mask[:, None] & (offs_p < head_dim)[None, :]
        xp = tl.load(x_row + offs_p[None, :], mask=pass_mask, other=0.0)
        tl.store(o_row + offs_p[None, :], xp, mask=pass_mask)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding on [T, heads, head_dim]; returns new tensors.

    ``cos_sin_cache`` is [max_position, rotary_dim] float32, cos in the first half.
    """
    positions = positions.contiguous()
    cos_sin_cache = _last_dim_contiguous(cos_sin_cache)
    return (
        _rope_one(q, positions, cos_sin_cache),
        _rope_one(k, positions, cos_sin_cache),
    )


def _rope_one(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    x = _last_dim_contiguous(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens, heads, head_dim = x.shape
    if tokens == 0:
        return out
    half_rot = cos_sin.shape[1] // 2
    pass_dim = head_dim - 2 * half_rot
    block_h = min(triton.next_power_of_2(heads), max(1, 2048 // head_dim))
    grid = (tokens, triton.cdiv(heads, block_h))
    _rope_kernel[grid](
        x, out, positions, cos_sin,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin.stride(0),
        heads, head_dim,
        HALF_ROT=half_rot,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half_rot),
        BLOCK_PASS=triton.next_power_of_2(pass_dim) if pass_dim > 0 else 0,
        num_warps=4,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcb,
    stride_kch,
    stride_vcp,
    stride_vcb,
    stride_vch,
    num_kv_heads,
    page_size,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    # Padding tokens (slot -1) write nothing; the mask keeps the grid fixed for CUDA graphs.
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :] & (slot >= 0)
    page = slot // page_size
    in_page = slot % page_size
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :],
                mask=mask)  # fmt: skip
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :],
                mask=mask)  # fmt: skip
    k_dst = k_cache_ptr + page * stride_kcp + in_page * stride_kcb + heads[:, None] * stride_kch
    v_dst = v_cache_ptr + page * stride_vcp + in_page * stride_vcb + heads[:, None] * stride_vch
    tl.store(k_dst + offs_d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes new keys/values ([T, kv_heads, head_dim]) into pages ([pages, block, kv_heads, d])."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_dim))
    grid = (tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, k_cache.shape[1],
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        num_warps=4,
    )  # fmt: skip


# --------------------------------------------------------------------------- rotary + KV store


@triton.jit
def _rotate_in_place(row_ptr, heads, head_mask, stride_h, cos, sin, offs, rot_mask,
                     HALF_ROT: tl.constexpr):
    """Rotates the first 2 * HALF_ROT channels of ``heads`` in place; returns both halves."""
    mask = head_mask[:, None] & rot_mask[None, :]
    ptrs = row_ptr + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF_ROT, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    out2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    tl.store(ptrs, out1, mask=mask)
    tl.store(ptrs + HALF_ROT, out2, mask=mask)
    return out1, out2


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcb, stride_kch, stride_vcp, stride_vcb, stride_vch,
    stride_cs, num_q_heads, num_kv_heads, q_blocks, page_size,
    HALF_ROT: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Axis 1: the first ``q_blocks`` programs rotate q heads; the rest rotate k heads and
    write them, with their v heads, into the token's cache slot (none for slot -1)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0)
    block = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    rot_mask = offs < HALF_ROT
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=rot_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF_ROT + offs, mask=rot_mask, other=0.0)
    # Names differ between the branches: compiled Triton needs one type per name.
    if block < q_blocks:
        q_heads = block * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        _rotate_in_place(q_ptr + token * stride_qt, q_heads, q_heads < num_q_heads, stride_qh,
                         cos, sin, offs, rot_mask, HALF_ROT)
    else:
        heads = (block - q_blocks) * BLOCK_HKV + tl.arange(0, BLOCK_HKV)
        head_mask = heads < num_kv_heads
        k_row = k_ptr + token * stride_kt
        k1, k2 = _rotate_in_place(k_row, heads, head_mask, stride_kh, cos, sin, offs,
                                  rot_mask, HALF_ROT)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # Padding tokens (slot -1) write nothing; the mask keeps the grid fixed for graphs.
        store_mask = head_mask[:, None] & (slot >= 0)
        page, in_page = slot // page_size, slot % page_size
        k_dst = k_cache_ptr + page * stride_kcp + in_page * stride_kcb + heads[:, None] * stride_kch
        v_dst = v_cache_ptr + page * stride_vcp + in_page * stride_vcb + heads[:, None] * stride_vch
        k_ty = k_cache_ptr.dtype.element_ty
        rot_store = store_mask & rot_mask[None, :]
        tl.store(k_dst + offs[None, :], k1.to(k_ty), mask=rot_store)
        tl.store(k_dst + HALF_ROT + offs[None, :], k2.to(k_ty), mask=rot_store)
        if BLOCK_PASS > 0:  # partial rotary: channels past rot_dim are stored unrotated
            offs_p = 2 * HALF_ROT + tl.arange(0, BLOCK_PASS)
            pass_mask = store_mask & (offs_p < HEAD_DIM)[None, :]
            k_pass = tl.load(k_row + heads[:, None] * stride_kh + offs_p[None, :], mask=pass_mask)
            tl.store(k_dst + offs_p[None, :], k_pass.to(k_ty), mask=pass_mask)
        offs_d = tl.arange(0, BLOCK_D)
        v_mask = store_mask & (offs_d < HEAD_DIM)[None, :]
        v_src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :]
        v = tl.load(v_src, mask=v_mask)
        tl.store(v_dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """``apply_rope`` on q and k in place, then ``store_kv`` of the rotated k and v: one launch.

    q, k, v are [T, heads, head_dim] with a unit stride on head_dim (views of the fused QKV
    projection are fine); caches are [pages, block, kv_heads, head_dim].
    """
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_rope_store_shapes(q, k, v, k_cache, v_cache)
    if tokens == 0:
        return
    cos_sin_cache = _last_dim_contiguous(cos_sin_cache)
    half_rot = cos_sin_cache.shape[1] // 2
    pass_dim = head_dim - 2 * half_rot
    max_heads = max(1, 2048 // head_dim)  # ~16 values per thread at 4 warps
    block_hq = min(triton.next_power_of_2(num_q_heads), max_heads)
    block_hkv = min(triton.next_power_of_2(num_kv_heads), max_heads)
    q_blocks = triton.cdiv(num_q_heads, block_hq)
    grid = (tokens, q_blocks + triton.cdiv(num_kv_heads, block_hkv))
    pdl = uses_pdl(q)
    _rope_store_kv_kernel[grid](
        q, k, v, k_cache, v_cache, positions.contiguous(), cos_sin_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cos_sin_cache.stride(0), num_q_heads, num_kv_heads, q_blocks, k_cache.shape[1],
        HALF_ROT=half_rot, HEAD_DIM=head_dim, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv,
        BLOCK_HALF=triton.next_power_of_2(half_rot),
        BLOCK_PASS=triton.next_power_of_2(pass_dim) if pass_dim > 0 else 0,
        BLOCK_D=triton.next_power_of_2(head_dim), PDL=pdl,
        num_warps=4, **launch_options(pdl),
    )  # fmt: skip


def _check_rope_store_shapes(q, k, v, k_cache, v_cache) -> None:
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("rope_store_kv works in place: q, k and v need a unit head_dim stride")
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not agree")


# --------------------------------------------------------------------------- helpers


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, hidden] view with a unit inner stride (copies only if it must)."""
    return _last_dim_contiguous(x.reshape(-1, x.shape[-1]))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _row_warps(block: int) -> int:
    # ~8 elements per thread keeps a whole row in registers up to hidden 16K.
    return max(1, min(16, block // 256))
