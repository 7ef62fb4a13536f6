"""Triton paged attention: split-KV decode (flash-decoding) and causal extend/prefill.

Importing this module imports Triton; only the registry and the CUDA branch of dispatch do
so, lazily. Kernels read the paged cache ``[num_pages, block_size, kv_heads, head_dim]``
through ``block_tables``, gathering page ids per token tile, so the page size is a runtime
value.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.ops.metadata import AttentionMetadata
from pdserve.ops.pdl import launch_options, uses_pdl
from pdserve.ops.triton_fused import gdc_launch_dependents, gdc_wait, store_kv

# Rows of q heads one decode program handles; tl.dot needs at least 16 rows, so smaller GQA
# groups are padded (decode is bandwidth-bound, the wasted MMA rows cost nothing).
_DECODE_BLOCK_H = 16
# Set to 1 to run decode attention as two launches (split kernel, then reduce kernel) instead
# of one, for A/B comparisons of the whole engine.
# Opt-in: on the H200 the one-launch merge measured 0.97x of split + reduce at batch 1 / 1K
# context, 1.07x at batch 8, ~1.0x at 64-256 (benchmarks/results/decode_attention_ab_h200_*):
# no gain where decode is latency-bound, so the proven two-launch path stays the default.
ONE_LAUNCH_DECODE_ENV = "PDSERVE_ONE_LAUNCH_DECODE"
# Set to 1 to fuse the rotary embedding and the new tokens' K/V store into the decode kernel
# of decode-only batches (one launch fewer per layer). Opt-in until timed and its GPU test
# run on a GPU (``bench_engine.py`` / ``profile_decode.py`` with and without it).
FUSED_ROPE_DECODE_ENV = "PDSERVE_FUSED_ROPE_DECODE"
# The most decode splits launched at any batch size for contexts longer than their share
# (``TritonAttentionBackend.num_kv_splits``; default 8); 1 turns this balancing of long
# contexts off, for A/B runs of the whole engine.
BALANCE_SPLITS_ENV = "PDSERVE_DECODE_BALANCE_SPLITS"
# The extend kernel's prefix splits on a GPU (``ExtendConfig.kv_splits``): 0 picks them per
# launch from the grid, the prefix and the SMs it runs on (``extend_kv_splits``); a power
# of two fixes them (1: no splits). The rule is the default: on the H100 (132 SMs, as the
# H200) whole mixed steps that it splits ran 0.81-0.95x of one split's time, the rest 1.00x
# (benchmarks/results/mixed_step_splits_h100_*.json).
EXTEND_SPLITS_ENV = "PDSERVE_EXTEND_KV_SPLITS"
# The tail launch (``ExtendConfig.tail_tiles``) on the GPU: 1 (the default) or 0. On the
# H100 (codellama-34b, one decode beside a chunk over a 2-16K prefix) steps where it
# launches ran 0.88-0.98x of one launch's time, the others 1.00x
# (benchmarks/results/mixed_step_packed_tail_h100_b4cb564.json).
EXTEND_TAIL_ENV = "PDSERVE_EXTEND_TAIL_TILES"
# Balancing keeps partial results for at most this many programs per SM (8 splits up to 64
# decodes of 8 KV heads, 4 at 128, 2 at 256): the partials buffer and the reduce kernel grow
# with batch x splits. The split kernel's grid does not: past each context's first
# ``split_cap`` splits it is a pool of the extra splits the contexts use (``_decode_grid``).
# What balancing costs contexts alike is the work before each program's first tile, not the
# programs that exit at once: on the H200 a pool of every split (b54a09f, each program
# scanning the batch's split counts) ran 1.10x a layer at 9 decodes alike, with fewer
# programs.
BALANCE_PROGRAMS_PER_SM = 32
# Decode batches up to this size are balanced (the kernel sums their lengths in one load).
BALANCE_MAX_SEQS = 512


@dataclass(frozen=True)
class ExtendConfig:
    """Tile shape and pipelining of the extend kernel (the benchmark sweeps these), and
    how its work is laid out over programs."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack_gqa: bool = False
    """One tile holds block_m // group tokens of all q heads of a kv head, so each K/V tile
    is loaded once per group instead of once per q head (the group must divide block_m)."""
    kv_splits: int = 1
    """Programs per query tile, each over a share of the cached prefix, merged by a second
    kernel: a power of two, or 0 to choose from the shape (``extend_kv_splits``). Pays off
    for short chunks over a long prefix, where one program per tile leaves SMs idle."""
    tail_tiles: bool = False  # on by default on a GPU (``default_extend_config``)
    """Rows past the longest chunk's last whole tile, where they fill at most half a tile, in a
    second launch of tiles packed by GQA group, with a split count of its own, where the
    split rule's cost model says that gains (``plan_extend_launches``). One launch gives those
    few rows a tile per q head, each reading the whole prefix: on the H100 (codellama-34b,
    10K prefix), 263 prompt tokens took the extend kernel 20.1 ms against 13.7 ms for 255;
    a tail of unpacked 16-row tiles took as long."""


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape and pipelining of the split-KV decode kernel, and how its splits merge:
    ``one_launch`` merges them in the same launch (the last split of each group to arrive,
    opt-in), else a second kernel merges them (the default)."""

    block_n: int
    num_warps: int
    num_stages: int
    one_launch: bool = False


# --------------------------------------------------------------------------- shared


@triton.jit
def _attend_tile(q, k, v, acc, m_i, l_i, mask, qk_scale, APPLY_MASK: tl.constexpr):
    """One online-softmax step (base-2 exponent, fp32 statistics)."""
    # fp32 models (the parity tests) need exact products; tl.dot would otherwise use TF32.
    if q.dtype == tl.float32:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if v.dtype == tl.float32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _gather_pages(table, offs_n, valid, page_size):
    """Page id (int64: page offsets can pass 2**31 elements) and in-page slot of each token."""
    page = tl.load(table + offs_n // page_size, mask=valid, other=0).to(tl.int64)
    return page, offs_n % page_size


@triton.jit
def _load_paged_kv(k_head, v_head, page, in_page, valid, offs_d, stride_kp, stride_kb, stride_vp,
                   stride_vb):
    """K and V rows of gathered tokens (``_gather_pages``); tokens not ``valid`` read 0."""
    k = tl.load(
        k_head + (page * stride_kp + in_page * stride_kb)[:, None] + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    v = tl.load(
        v_head + (page * stride_vp + in_page * stride_vb)[:, None] + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    return k, v


# --------------------------------------------------------------------------- decode


@triton.jit
def _split_range(seq_len, split, cap, split_tokens, BLOCK_N: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr):
    """Token range [start, end) of one split, and how many splits have tokens (at least 1).

    The range comes from seq_lens on the device: the grid stays fixed, so a CUDA graph
    captured once replays for any context lengths. A context takes one split per
    ``MIN_SPLIT_TOKENS`` up to ``cap`` (short contexts use fewer splits, the rest exit at
    once, to keep the partial-result traffic small), and at least one per ``split_tokens``
    (``_balanced_slot``), up to ``NUM_SPLITS``."""
    by_length = tl.minimum((seq_len + MIN_SPLIT_TOKENS - 1) // MIN_SPLIT_TOKENS, cap)
    by_share = (seq_len + split_tokens - 1) // split_tokens
    num_splits = tl.minimum(tl.maximum(tl.maximum(by_length, by_share), 1), NUM_SPLITS)
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = tl.maximum((num_tiles + num_splits - 1) // num_splits, 1)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    # Every split below this count starts before seq_len; a zero-length context keeps one.
    used_splits = tl.maximum((num_tiles + tiles_per_split - 1) // tiles_per_split, 1)
    return start, end, used_splits


@triton.jit
def _balanced_slot(seq_lens_ptr, slot, num_seqs, programs_per_split, balance_programs, cap,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   MIN_SPLIT_TOKENS: tl.constexpr, MAX_SEQS: tl.constexpr):
    """The context and split that program ``slot`` of a balanced launch serves, that
    context's length, and the tokens per split that spread the batch's whole context
    evenly over about ``balance_programs`` programs (a context far longer than the others
    then takes more splits than its batch size alone gives it, instead of one program
    reading all of it while the rest of the GPU waits).

    The first ``num_seqs * cap`` slots are each context's first ``cap`` splits, as an
    unbalanced launch has them. The slots after them are a pool for the splits past the
    cap: the contexts' extra split counts are summed in order and pool slot e serves the
    extra split that covers e, so no program starts only to find an extra split empty. A
    pool slot past the last extra split gets context ``num_seqs`` (nothing to do). One load
    of the batch's lengths (``MAX_SEQS`` of them, padded) serves all of it, so the mapping
    adds no memory round trip before the tiles' loads; a loop here would cost the tile loop
    its software pipelining (no ``cp.async`` in the sm_90 code, Triton 3.6)."""
    offs = tl.arange(0, MAX_SEQS)
    real = offs < num_seqs
    lens = tl.load(seq_lens_ptr + offs, mask=real, other=0)
    total = tl.sum(lens.to(tl.int64))
    wanted = (total * programs_per_split + balance_programs - 1) // balance_programs
    split_tokens = tl.maximum(wanted, MIN_SPLIT_TOKENS).to(tl.int32)
    if slot < num_seqs * cap:
        seq = slot // cap
        split = slot - seq * cap
        seq_len = tl.sum(tl.where(offs == seq, lens, 0))
    else:
        # Only pool slots pay for the scan (the first cap splits are found without it).
        _, _, used = _split_range(lens, 0, cap, split_tokens, BLOCK_N, NUM_SPLITS,
                                  MIN_SPLIT_TOKENS)  # fmt: skip
        extra = tl.where(real, tl.maximum(used - cap, 0), 0)
        ends = tl.cumsum(extra, 0)
        pool_slot = slot - num_seqs * cap
        mine = (ends - extra <= pool_slot) & (pool_slot < ends)  # these sums need only the scan
        seq_plus_one = tl.sum(tl.where(mine, offs + 1, 0))  # 0: past every extra split
        split = cap + pool_slot - tl.sum(tl.where(mine, ends - extra, 0))
        seq_len = tl.sum(tl.where(mine, lens, 0))
        seq = tl.where(seq_plus_one > 0, seq_plus_one - 1, num_seqs)
    return seq, split, seq_len, split_tokens


@triton.jit
def _rope_factors(cos_sin_row, offs_d, HALF_ROT: tl.constexpr):
    """Per channel d of a head, neox-style rotary (``reference.apply_rope``) as
    ``x[d] * cos[d] + x[partner[d]] * sin[d]``: the first half of the rotated channels takes
    -x2 * sin, the second half +x1 * sin, and channels past the rotary dims pass unchanged."""
    first_half = offs_d < HALF_ROT
    rotated = offs_d < 2 * HALF_ROT
    freq = tl.where(first_half, offs_d, offs_d - HALF_ROT)
    cos = tl.load(cos_sin_row + freq, mask=rotated, other=1.0)
    sin = tl.load(cos_sin_row + HALF_ROT + freq, mask=rotated, other=0.0)
    sin = tl.where(first_half, -sin, sin)
    partner = tl.where(first_half, offs_d + HALF_ROT, tl.where(rotated, freq, offs_d))
    return cos, sin, partner


@triton.jit
def _rotated(x, x_partner, cos, sin):
    """Rotary of rows ``x`` in fp32, rounded once to their dtype, as the reference does."""
    out = x.to(tl.float32) * cos[None, :] + x_partner.to(tl.float32) * sin[None, :]
    return out.to(x.dtype)


@triton.jit
def _store_new_kv(k_row, v_row, k_head, v_head, slot, page_size, stride_kp, stride_kb,
                  stride_vp, stride_vb, offs_d, partner, cos, sin):
    """Rotates the new token's k (one kv head) and stores it and v into cache slot ``slot``
    (-1, a padding row: nothing)."""
    keep = (offs_d >= 0) & (slot >= 0)
    page, in_page = slot // page_size, slot % page_size
    k = tl.load(k_row + offs_d)
    k_partner = tl.load(k_row + partner)
    k = (k.to(tl.float32) * cos + k_partner.to(tl.float32) * sin).to(k.dtype)
    tl.store(k_head + page * stride_kp + in_page * stride_kb + offs_d,
             k.to(k_head.dtype.element_ty), mask=keep)  # fmt: skip
    tl.store(v_head + page * stride_vp + in_page * stride_vb + offs_d,
             tl.load(v_row + offs_d).to(v_head.dtype.element_ty), mask=keep)  # fmt: skip


@triton.jit
def _attend_range(q, k_head, v_head, table, start, end, stride_kp, stride_kb, stride_vp,
                  stride_vb, qk_scale, page_size, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Online softmax of the group's q rows over the tokens [start, end) of one sequence."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        page, in_page = _gather_pages(table, offs_n, valid, page_size)
        k, v = _load_paged_kv(k_head, v_head, page, in_page, valid, offs_d, stride_kp, stride_kb,
                              stride_vp, stride_vb)  # fmt: skip
        acc, m_i, l_i = _attend_tile(q, k, v, acc, m_i, l_i, valid[None, :], qk_scale, True)
    return acc, m_i, l_i


# Split counts and the balance target are plain values, not specialised on (==1, multiples
# of 16): a new value met while serving must not compile a kernel variant.
@triton.jit(do_not_specialize=["num_seqs", "split_cap", "balance_programs"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    used_splits_ptr,
    arrivals_ptr,
    out_ptr,
    positions_ptr,
    cos_sin_ptr,
    k_new_ptr,
    v_new_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_cs,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kp,
    stride_kb,
    stride_kh,
    stride_vp,
    stride_vb,
    stride_vh,
    stride_bt,
    stride_mo_s,
    stride_mo_h,
    stride_mo_split,
    stride_ml_s,
    stride_ml_h,
    stride_ot,
    stride_oh,
    qk_scale,
    page_size,
    num_seqs,
    split_cap,
    balance_programs,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_TOKENS: tl.constexpr,
    BALANCE: tl.constexpr,
    BALANCE_WIDTH: tl.constexpr,
    ONE_LAUNCH: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    FUSE_ROPE: tl.constexpr,
    HALF_ROT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program = (decode seq, kv head x head block, split): all q heads of the group
    share each K/V tile, so K/V are read from memory once per group. The grid is (seq,
    head block, split), or with ``BALANCE`` (head block, slot, 1): each context's first
    ``split_cap`` splits, then a pool of the extra splits (``_balanced_slot``).

    Splits without tokens exit at once, and a sequence with one used split writes its
    output directly. Otherwise each used split stores its partial, and with ``ONE_LAUNCH``
    the last to arrive merges them; without it ``_decode_reduce_kernel`` merges them in a
    second launch (the first split tells it how many there are).

    ``BALANCE``: a context also takes a split per its share of the batch's tokens
    (``_balanced_slot``, up to ``NUM_SPLITS``), beside the one per ``MIN_SPLIT_TOKENS`` up to
    ``split_cap``.

    ``FUSE_ROPE``: q, and k of the new token, arrive unrotated; each program rotates its q
    rows on load, and the split that holds the new token (the last used one) rotates k and
    stores it with v into the token's cache slot before it reads its tiles, which saves
    the step's ``rope_store_kv`` launch."""
    if PDL:  # launched early: nothing is read before the step before has finished
        gdc_wait()
        gdc_launch_dependents()
    # Balanced, the head block is the grid's first axis, so every context's first splits
    # (all head blocks) launch before the pool's slots and spread over the SMs first.
    head_program = tl.program_id(0) if BALANCE else tl.program_id(1)
    head_programs = tl.num_programs(0) if BALANCE else tl.num_programs(1)
    blocks_per_group = (GROUP + BLOCK_H - 1) // BLOCK_H
    kv_head = head_program // blocks_per_group
    head_block = head_program % blocks_per_group
    if BALANCE:
        seq, split, seq_len, split_tokens = _balanced_slot(
            seq_lens_ptr, tl.program_id(1), num_seqs, head_programs, balance_programs,
            split_cap, BLOCK_N, NUM_SPLITS, MIN_SPLIT_TOKENS, BALANCE_WIDTH,
        )  # fmt: skip
        if seq >= num_seqs:
            return
    else:
        seq, split = tl.program_id(0), tl.program_id(2)
        seq_len, split_tokens = tl.load(seq_lens_ptr + seq), 1 << 30
    # No context takes a split per fewer than MIN_SPLIT_TOKENS: such programs leave at once.
    if split > 0 and split * MIN_SPLIT_TOKENS >= seq_len:
        return
    start, end, used_splits = _split_range(seq_len, split, split_cap, split_tokens, BLOCK_N,
                                           NUM_SPLITS, MIN_SPLIT_TOKENS)  # fmt: skip
    if split >= used_splits:
        return
    if NUM_SPLITS > 1 and split == 0 and head_program == 0:
        tl.store(used_splits_ptr + seq, used_splits)  # what the reduce kernel merges

    in_group = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = in_group < GROUP
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + seq * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=head_mask[:, None], other=0.0)
    if FUSE_ROPE:
        pos = tl.load(positions_ptr + seq).to(tl.int64)
        cos, sin, partner = _rope_factors(cos_sin_ptr + pos * stride_cs, offs_d, HALF_ROT)
        q_partner = tl.load(q_rows + partner[None, :], mask=head_mask[:, None], other=0.0)
        q = _rotated(q, q_partner, cos, sin)
        if split == used_splits - 1:
            _store_new_kv(k_new_ptr + seq * stride_knt + kv_head * stride_knh,
                          v_new_ptr + seq * stride_vnt + kv_head * stride_vnh,
                          k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
                          tl.load(slot_ptr + seq).to(tl.int64), page_size, stride_kp,
                          stride_kb, stride_vp, stride_vb, offs_d, partner, cos, sin)
            # Every thread's slot stores come before any thread's tile loads: the barrier
            # makes a block's global writes visible to the whole block.
            tl.debug_barrier()
    acc, m_i, l_i = _attend_range(
        q, k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        block_tables_ptr + seq * stride_bt, start, end, stride_kp, stride_kb, stride_vp,
        stride_vb, qk_scale, page_size, BLOCK_H, HEAD_DIM, BLOCK_N,
    )  # fmt: skip

    # An empty split leaves l_i == 0: its log-sum-exp is -inf and the merge ignores it.
    has_work = l_i > 0.0
    o = acc / tl.where(has_work, l_i, 1.0)[:, None]
    out = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    # One split is the whole answer: written here (what a merge of one split computes is
    # this very value).
    if used_splits == 1:
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        lse = tl.where(has_work, m_i + tl.log2(tl.where(has_work, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + seq * stride_ml_s + heads * stride_ml_h + split, lse,
                 mask=head_mask)  # fmt: skip
        mid_o = (mid_o_ptr + seq * stride_mo_s + heads[:, None] * stride_mo_h
                 + split * stride_mo_split + offs_d[None, :])  # fmt: skip
        tl.store(mid_o, o, mask=head_mask[:, None] & (start < end))
        if ONE_LAUNCH:
            _arrive_and_merge(
                mid_o_ptr + seq * stride_mo_s, mid_lse_ptr + seq * stride_ml_s,
                arrivals_ptr + seq * head_programs + head_program,
                out_ptr + seq * stride_ot,
                kv_head * GROUP, head_block * BLOCK_H, used_splits, stride_mo_h, stride_mo_split,
                stride_ml_h, stride_oh, GROUP, ROWS, HEAD_DIM, NUM_SPLITS, MERGE_SPLITS,
            )  # fmt: skip


@triton.jit
def _arrive_and_merge(mid_o_seq, mid_lse_seq, arrivals, out_seq, first_head, first_row,
                      used_splits, stride_mo_h, stride_mo_split, stride_ml_h, stride_oh,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    """Counts this split in; the last split of the (sequence, head block) to arrive merges
    all of them into the output and sets the count back to 0 for the next launch (CUDA-graph
    replays included), so no launch has to clear it first."""
    # Every thread's partial stores come before the barrier; the release half of the atomic
    # then publishes them at GPU scope (the pattern of CUTLASS's split-K semaphore).
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
    if arrived == used_splits - 1:
        # The acquire half made the other splits' partials visible to the thread that did the
        # atomic; the barrier extends that to every thread, and the loads skip L1 (".cg").
        tl.debug_barrier()
        _merge_group(mid_o_seq, mid_lse_seq, out_seq, first_head, first_row, used_splits,
                     stride_mo_h, stride_mo_split, stride_ml_h, stride_oh, GROUP, ROWS,
                     HEAD_DIM, NUM_SPLITS, MERGE_SPLITS)  # fmt: skip
        tl.store(arrivals, 0)


@triton.jit
def _merge_group(mid_o_seq, mid_lse_seq, out_seq, first_head, first_row, used_splits,
                 stride_mo_h, stride_mo_split, stride_ml_h, stride_oh, GROUP: tl.constexpr,
                 ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 MERGE_SPLITS: tl.constexpr):
    """Output rows of a head block from their first ``used_splits`` partials, merged by
    log-sum-exp (base 2) ``MERGE_SPLITS`` splits at a time with a running maximum. All q
    heads load at once and no store comes between the chunks' loads, so they can all be in
    flight together (a loop that stored each head would wait for one L2 round trip per head).
    """
    rows = first_row + tl.arange(0, ROWS)
    row_valid = rows < GROUP
    heads = first_head + rows
    offs_d = tl.arange(0, HEAD_DIM)
    m_i, denom, acc = _no_partials(ROWS, HEAD_DIM)
    for chunk in tl.static_range(NUM_SPLITS // MERGE_SPLITS):
        offs_s = chunk * MERGE_SPLITS + tl.arange(0, MERGE_SPLITS)
        # Only used splits stored a partial; every one of them has tokens.
        written = row_valid[:, None] & (offs_s < used_splits)[None, :]
        lse = tl.load(mid_lse_seq + heads[:, None] * stride_ml_h + offs_s[None, :], mask=written,
                      other=float("-inf"), cache_modifier=".cg")  # fmt: skip
        o = tl.load(
            mid_o_seq + heads[:, None, None] * stride_mo_h
            + offs_s[None, :, None] * stride_mo_split + offs_d[None, None, :],
            mask=written[:, :, None], other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        m_i, denom, acc = _fold_partials(m_i, denom, acc, lse, o)
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(out_seq + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_seq.dtype.element_ty), mask=row_valid[:, None])  # fmt: skip


@triton.jit
def _no_partials(ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The state of a log-sum-exp merge before its first partial."""
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    return m_i, tl.zeros([ROWS], dtype=tl.float32), tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)


@triton.jit
def _fold_partials(m_i, denom, acc, lse, o):
    """Folds split partials (``lse`` [rows, n], ``o`` [rows, n, dims]) into a running
    log-sum-exp merge: maximum, denominator and weighted sum of each row."""
    m_new = tl.maximum(m_i, tl.max(lse, 1))
    # Rows with nothing yet (or invalid rows) shift by 0 so no NaN is formed.
    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - shift)
    weight = tl.exp2(lse - shift[:, None])
    denom = denom * alpha + tl.sum(weight, 1)
    acc = acc * alpha[:, None] + tl.sum(weight[:, :, None] * o, 1)
    return m_new, denom, acc


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    used_splits_ptr,
    out_ptr,
    stride_mo_s,
    stride_mo_h,
    stride_mo_split,
    stride_ml_s,
    stride_ml_h,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merges the used splits of one (seq, q head) by their log-sum-exp (base 2): the
    second launch of the two-launch path. A sequence with one used split was written by
    the split kernel itself."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    # Both loads in flight at once: unused splits' slots hold stale values, masked after.
    used_splits = tl.load(used_splits_ptr + seq)
    lse = tl.load(mid_lse_ptr + seq * stride_ml_s + head * stride_ml_h + offs_s)
    if used_splits == 1:
        return
    lse = tl.where(offs_s < used_splits, lse, float("-inf"))
    used = lse > float("-inf")
    lse_max = tl.max(lse, 0)
    # A zero-length context leaves every split at -inf: shift by 0 so no NaN is formed.
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    weight = tl.where(used, tl.exp2(lse - lse_max), 0.0)
    # Unused splits never wrote their partial output: mask the load, do not read garbage.
    o = tl.load(
        mid_o_ptr
        + seq * stride_mo_s
        + head * stride_mo_h
        + offs_s[:, None] * stride_mo_split
        + offs_d[None, :],
        mask=used[:, None],
        other=0.0,
    )
    denom = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
    )


@dataclass(frozen=True)
class NewTokenRope:
    """What the decode kernel needs to rotate q and store each sequence's new K/V itself
    (row i of each tensor is sequence i's token): k and v [T, kv_heads, head_dim], unrotated,
    a unit stride on head_dim; positions [T]; the [max_position, rotary_dim] cos/sin cache;
    and the cache slots [T] (-1: a padding row, nothing stored)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int,
    min_split_tokens: int = 64,
    config: DecodeConfig | None = None,
    rope: NewTokenRope | None = None,
    split_cap: int | None = None,
    balance_programs: int = 0,
) -> torch.Tensor | None:
    """Attention of the first ``len(seq_lens)`` tokens of ``q`` (one per sequence) over
    their paged context; writes ``out[:len(seq_lens)]``.

    No host sync and a grid fixed by (batch, heads, num_splits): safe to capture in a CUDA
    graph and replay with new ``seq_lens``/``block_tables`` contents. The one-launch path
    (``config.one_launch``) keeps arrival counters per device and stream, cleared when
    allocated: run a batch size eagerly before capturing it (a capture cannot clear memory).
    With ``rope``, q is unrotated and the cache does not hold the new tokens yet: the
    kernel rotates q and k and stores k and v (``rope_store_kv`` fused in); q is left as is.

    A context takes one split per ``min_split_tokens`` up to ``split_cap`` (None: all
    ``num_splits``); with ``balance_programs`` (0: off) also one per its share of the
    whole batch's context spread over that many programs, up to ``num_splits``. Returns
    the splits each context used (int32 per sequence; None for one split, all used one).
    """
    batch = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    _check_attention_shapes(q, k_cache, v_cache)
    if balance_programs and batch > BALANCE_MAX_SEQS:
        raise ValueError(f"balancing covers at most {BALANCE_MAX_SEQS} sequences, got {batch}")
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    config = config or default_decode_config(head_dim, q.device)
    group = num_q_heads // num_kv_heads
    mid_o = torch.empty(
        (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    used_splits = torch.empty((batch,), dtype=torch.int32, device=q.device)
    split_cap = num_splits if split_cap is None else min(split_cap, num_splits)
    head_programs = num_kv_heads * triton.cdiv(group, _DECODE_BLOCK_H)
    grid = _decode_grid(batch, head_programs, num_splits, split_cap, balance_programs)
    one_launch = config.one_launch and num_splits > 1
    arrivals = _arrival_counters(batch * head_programs, q.device) if one_launch else mid_lse
    rows = triton.next_power_of_2(min(group, _DECODE_BLOCK_H))  # q heads a merge covers
    rope_args, half_rot = _rope_args(rope, q, k_cache, batch, seq_lens)
    pdl = uses_pdl(q)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, used_splits, arrivals, out,
        *rope_args[:5], q.stride(0), q.stride(1), *rope_args[5:],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        scale * math.log2(math.e),
        page_size,
        batch,
        split_cap,
        balance_programs,
        GROUP=group,
        BLOCK_H=_DECODE_BLOCK_H,
        ROWS=rows,
        HEAD_DIM=head_dim,
        BLOCK_N=config.block_n,
        NUM_SPLITS=num_splits,
        MIN_SPLIT_TOKENS=max(min_split_tokens, config.block_n),
        BALANCE=balance_programs > 0,
        BALANCE_WIDTH=balance_width(batch) if balance_programs else 16,
        ONE_LAUNCH=one_launch,
        MERGE_SPLITS=_merge_splits(num_splits, rows, head_dim),
        FUSE_ROPE=rope is not None,
        HALF_ROT=half_rot,
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )  # fmt: skip
    if num_splits == 1:  # the split kernel wrote ``out`` itself, one split a context
        return None
    if one_launch:  # the split kernel merged the splits itself
        return used_splits
    _decode_reduce_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, used_splits, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim,
        PDL=pdl,
        num_warps=4 if head_dim >= 128 else 2,
        **launch_options(pdl),
    )  # fmt: skip
    return used_splits


def balance_width(batch: int) -> int:
    """Lengths a balanced launch loads at once: the batch rounded up to a power of two, at
    least 16. Every program sums and scans them before its first tile, so a vector as wide
    as the largest batch would put that width on every small batch's critical path; one
    kernel variant per width instead."""
    return max(16, triton.next_power_of_2(batch))


def _decode_grid(batch: int, head_programs: int, num_splits: int, split_cap: int,
                 balance_programs: int) -> tuple[int, int, int]:
    """The split kernel's grid. Balanced: ``split_cap`` slots a context, then a pool for
    the splits past them. A context takes at most ``split_cap`` splits by its length, or
    one more than the full shares of the batch's tokens it holds (a share being
    ``head_programs / balance_programs`` of them), so the extra splits of the whole batch
    are at most ``balance_programs // head_programs``."""
    if not balance_programs:
        return batch, head_programs, num_splits
    return head_programs, batch * split_cap + balance_programs // head_programs, 1


def _rope_args(rope: NewTokenRope | None, q: torch.Tensor, k_cache: torch.Tensor, batch: int,
               seq_lens: torch.Tensor) -> tuple[tuple, int]:
    """The split kernel's rotary arguments: five pointers (positions, cos/sin, k, v, slots),
    then five strides; and half the rotary dims. Without ``rope`` they are placeholders
    the kernel never reads."""
    if rope is None:
        return (seq_lens, q, q, q, seq_lens, 0, 0, 0, 0, 0), 0
    k, v, cos_sin = rope.k, rope.v, rope.cos_sin_cache
    if k.shape[0] < batch or k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape:
        raise ValueError(f"rope k {tuple(k.shape)} and v {tuple(v.shape)} must be [>= {batch}, "
                         f"kv_heads, head_dim] as the cache's {tuple(k_cache.shape[2:])}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("rope k, v and the cos/sin cache need a unit stride on their last axis")
    if cos_sin.shape[1] > k.shape[2] or cos_sin.shape[1] % 2:
        raise ValueError(f"rotary dims {cos_sin.shape[1]} must be even and at most head_dim")
    pointers = (rope.positions.contiguous(), cos_sin, k, v, rope.slot_mapping)
    strides = (cos_sin.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    return pointers + strides, cos_sin.shape[1] // 2


def _merge_splits(num_splits: int, rows: int, head_dim: int) -> int:
    """Splits the one-launch merge loads at a time: 8K fp32 partial values (64 registers a
    thread at 4 warps), all of them at short contexts (8 splits of 8 heads x 128 dims)."""
    return min(num_splits, max(1, 8192 // (rows * head_dim)))


# Arrival counters of the one-launch decode: a row per (device, stream). Launches on one
# stream run one after another, each leaving its row at 0; launches that may overlap come
# from different streams (a CUDA graph uses the row of the stream it was captured on). Rows
# are cleared when allocated, which a capture cannot do, so an eager launch always leaves a
# spare row: a capture on a new stream (such as torch.cuda.graph's own) takes it.
_arrivals: dict[torch.device, torch.Tensor] = {}
_row_of_stream: dict[tuple[torch.device, int], int] = {}
_retired_arrivals: list[torch.Tensor] = []  # never freed: captured graphs keep the address


def _arrival_counters(count: int, device: torch.device) -> torch.Tensor:
    """``count`` int32 counters at 0, owned by the current stream of ``device``."""
    key = (device, _stream_id(device))
    row = _row_of_stream.setdefault(key, sum(d == device for d, _ in _row_of_stream))
    counters = _arrivals.get(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    spare = 0 if capturing else 1
    if counters is None or counters.shape[0] < row + 1 + spare or counters.shape[1] < count:
        if capturing:
            raise RuntimeError(
                f"one-launch decode attention needs {count} cleared arrival counters for a "
                "CUDA-graph capture on a new stream: run it eagerly (at this batch size or "
                "larger) before capturing"
            )
        counters = _grow_arrivals(device, row + 1 + spare, count, counters)
    return counters[row]


def _grow_arrivals(device: torch.device, num_rows: int, count: int,
                   old: torch.Tensor | None) -> torch.Tensor:
    if old is not None:
        _retired_arrivals.append(old)  # in-flight launches and captured graphs still use it
        num_rows, count = max(num_rows, old.shape[0]), max(count, old.shape[1])
    shape = (triton.next_power_of_2(max(num_rows, 8)), triton.next_power_of_2(max(count, 4096)))
    _arrivals[device] = torch.zeros(shape, dtype=torch.int32, device=device)
    return _arrivals[device]


def _stream_id(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def default_decode_config(head_dim: int, device: torch.device) -> DecodeConfig:
    one_launch = os.environ.get(ONE_LAUNCH_DECODE_ENV, "0") not in ("", "0")
    if device.type != "cuda":  # interpreter: small tiles keep it fast and exercise the loops
        return DecodeConfig(block_n=16, num_warps=1, num_stages=1, one_launch=one_launch)
    # 64 tokens x 128 dims of K and of V per stage: 32 KiB, two stages in flight per program.
    block_n = 64 if head_dim <= 128 else 32
    return DecodeConfig(block_n=block_n, num_warps=4, num_stages=2, one_launch=one_launch)


# --------------------------------------------------------------------------- extend


# first_seq changes with the number of decodes in a mixed batch: specialising on it (==1,
# divisible by 16) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["first_seq", "row_start"])
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kcp,
    stride_kcb,
    stride_kch,
    stride_vcp,
    stride_vcb,
    stride_vch,
    stride_bt,
    stride_mo_t,
    stride_mo_h,
    stride_mo_s,
    stride_ml_t,
    stride_ml_h,
    qk_scale,
    page_size,
    first_seq,
    row_start,
    GROUP: tl.constexpr,
    ROW_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_SPLITS: tl.constexpr,
):
    """One program = (query tile x prefix split, head slot, sequence). A tile has BLOCK_M
    rows: BLOCK_M tokens of one q head (``ROW_HEADS`` 1), or BLOCK_M // GROUP tokens of all
    GROUP q heads of one kv head (``ROW_HEADS`` GROUP, GQA packing: each K/V tile is loaded
    once for the whole group). The cached prefix is read through the page table; the new
    tokens' own K/V are read from the contiguous step inputs, with the causal mask applied
    only on the diagonal tiles and tiles above the diagonal skipped. With ``KV_SPLITS`` > 1
    each split attends to its share of the prefix (the last one also to the new tokens) and
    stores a partial for ``_extend_merge_kernel``, at row ``row_start`` less than its token's.
    The tiles start ``row_start`` tokens into each sequence's new tokens (the tail launch of
    ``_extend_tail``)."""
    TOKENS: tl.constexpr = BLOCK_M // ROW_HEADS
    split = tl.program_id(0) % KV_SPLITS
    # Highest query tiles have the most keys under the causal mask: launch them first so
    # the short ones fill the tail of the last wave.
    m_block = tl.num_programs(0) // KV_SPLITS - 1 - tl.program_id(0) // KV_SPLITS
    seq = first_seq + tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_tok = row_start + m_block * TOKENS
    if first_tok >= num_new:
        return
    prefix_len = tl.load(seq_lens_ptr + seq) - num_new
    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // ROW_HEADS
    heads = tl.program_id(1) * ROW_HEADS + rows % ROW_HEADS
    kv_head = tl.program_id(1) * ROW_HEADS // GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = tok < num_new
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Phase 1: this split's share of the cached prefix, visible to every new token.
    start, end = _prefix_range(prefix_len, split, BLOCK_N, KV_SPLITS)
    acc, m_i, l_i = _attend_prefix(
        q, acc, m_i, l_i, block_tables_ptr + seq * stride_bt, k_cache_ptr + kv_head * stride_kch,
        v_cache_ptr + kv_head * stride_vch, start, end, stride_kcp, stride_kcb, stride_vcp,
        stride_vcb, qk_scale, page_size, HEAD_DIM, BLOCK_N,
    )  # fmt: skip
    # Phase 2: the new tokens (causal), in the last split.
    if split == KV_SPLITS - 1:
        acc, m_i, l_i = _attend_new(
            q, acc, m_i, l_i, k_ptr + q_start * stride_kt + kv_head * stride_kh,
            v_ptr + q_start * stride_vt + kv_head * stride_vh, tok, first_tok, num_new,
            stride_kt, stride_vt, qk_scale, HEAD_DIM, BLOCK_N, TOKENS,
        )  # fmt: skip

    has_work = l_i > 0.0
    o = acc / tl.where(has_work, l_i, 1.0)[:, None]
    store_rows = (q_start + tok)[:, None]
    if KV_SPLITS == 1:
        tl.store(out_ptr + store_rows * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])  # fmt: skip
    else:
        # An empty split leaves l_i == 0: its log-sum-exp is -inf and the merge skips it.
        lse = tl.where(has_work, m_i + tl.log2(tl.where(has_work, l_i, 1.0)), float("-inf"))
        # A launch starting past row 0 keeps its partials from row 0 of each sequence's rows.
        part_rows = q_start + tok - row_start
        tl.store(mid_lse_ptr + part_rows * stride_ml_t + heads * stride_ml_h + split, lse,
                 mask=row_valid)  # fmt: skip
        mid_o = (mid_o_ptr + part_rows[:, None] * stride_mo_t + heads[:, None] * stride_mo_h
                 + split * stride_mo_s + offs_d[None, :])  # fmt: skip
        tl.store(mid_o, o, mask=row_valid[:, None])


@triton.jit
def _prefix_range(prefix_len, split, BLOCK_N: tl.constexpr, KV_SPLITS: tl.constexpr):
    """Tokens [start, end) of the prefix that ``split`` attends to: whole tiles, as even a
    share as the tile count allows (the last splits may be short or empty)."""
    num_tiles = (prefix_len + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (num_tiles + KV_SPLITS - 1) // KV_SPLITS
    start = tl.minimum(split * tiles_per_split * BLOCK_N, prefix_len)
    end = tl.minimum(start + tiles_per_split * BLOCK_N, prefix_len)
    return start, end


@triton.jit
def _attend_prefix(q, acc, m_i, l_i, table, k_head, v_head, start, end, stride_kcp, stride_kcb,
                   stride_vcp, stride_vcb, qk_scale, page_size, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Online softmax over the cached tokens [start, end), ``start`` a multiple of
    BLOCK_N: whole tiles unmasked, the ragged last one masked."""
    offs_d = tl.arange(0, HEAD_DIM)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        page, in_page = _gather_pages(table, offs_n, offs_n < full_end, page_size)
        k = tl.load(k_head + (page * stride_kcp + in_page * stride_kcb)[:, None] + offs_d[None, :])
        v = tl.load(v_head + (page * stride_vcp + in_page * stride_vcb)[:, None] + offs_d[None, :])
        acc, m_i, l_i = _attend_tile(q, k, v, acc, m_i, l_i, None, qk_scale, False)
    if full_end < end:
        offs_n = full_end + tl.arange(0, BLOCK_N)
        key_valid = offs_n < end
        page, in_page = _gather_pages(table, offs_n, key_valid, page_size)
        k, v = _load_paged_kv(k_head, v_head, page, in_page, key_valid, offs_d, stride_kcp,
                              stride_kcb, stride_vcp, stride_vcb)  # fmt: skip
        acc, m_i, l_i = _attend_tile(q, k, v, acc, m_i, l_i, key_valid[None, :], qk_scale, True)
    return acc, m_i, l_i


@triton.jit
def _attend_new(q, acc, m_i, l_i, k_base, v_base, tok, first_tok, num_new, stride_kt, stride_vt,
                qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr):
    """Online softmax over the new tokens up to each row's own (``tok``): key tiles wholly
    below the tile's first token unmasked, the rest up to its last token causally masked."""
    offs_d = tl.arange(0, HEAD_DIM)
    # A packed tile (TOKENS < BLOCK_N) can start inside a key tile: that tile is masked.
    unmasked_end = first_tok // BLOCK_N * BLOCK_N
    for n0 in range(0, unmasked_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :])
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :])
        acc, m_i, l_i = _attend_tile(q, k, v, acc, m_i, l_i, None, qk_scale, False)
    diag_end = tl.minimum(first_tok + TOKENS, num_new)
    for n0 in range(unmasked_end, diag_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        key_valid = offs_n < num_new
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
                    mask=key_valid[:, None], other=0.0)  # fmt: skip
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :],
                    mask=key_valid[:, None], other=0.0)  # fmt: skip
        causal = (offs_n[None, :] <= tok[:, None]) & key_valid[None, :]
        acc, m_i, l_i = _attend_tile(q, k, v, acc, m_i, l_i, causal, qk_scale, True)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["first_seq", "row_start"])
def _extend_merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, query_start_loc_ptr, stride_mo_t,
                         stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_ot,
                         stride_oh, first_seq, row_start, HEAD_DIM: tl.constexpr,
                         BLOCK_T: tl.constexpr, KV_SPLITS: tl.constexpr):
    """One program = (BLOCK_T new tokens, q head, sequence): merges the splits' partials
    by their log-sum-exp (base 2) with a running maximum; the tokens from ``row_start`` on,
    whose partials start at row 0 of each sequence's rows (``_extend_kernel``)."""
    seq = first_seq + tl.program_id(2)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok = row_start + tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = tok < num_new
    rows = q_start + tok
    part_rows = rows - row_start
    offs_d = tl.arange(0, HEAD_DIM)
    m_i, denom, acc = _no_partials(BLOCK_T, HEAD_DIM)
    for split in tl.static_range(KV_SPLITS):
        lse = tl.load(mid_lse_ptr + part_rows * stride_ml_t + head * stride_ml_h + split,
                      mask=valid, other=float("-inf"))  # fmt: skip
        o = tl.load(mid_o_ptr + part_rows[:, None] * stride_mo_t + head * stride_mo_h
                    + split * stride_mo_s + offs_d[None, :],
                    mask=(lse > float("-inf"))[:, None], other=0.0)  # fmt: skip
        m_i, denom, acc = _fold_partials(m_i, denom, acc, lse[:, None], o[:, None, :])
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])  # fmt: skip


# Auto split count (kv_splits=0): each split keeps at least this many prefix tokens, so the
# partials' traffic (an fp32 row per split) stays small next to the K/V it saves re-reading.
MIN_EXTEND_SPLIT_TOKENS = 512
# At 16 splits the merge kernel took 10.0 ms a step (48 launches of 7 rows x 64 heads) where
# 8 took 0.55 ms, on the H100 (mixed_step_packed_tail_h100_8f8ef5d.json): no launch splits
# further than 8.
_MAX_EXTEND_SPLITS = 8
# What a split costs beside its share of the prefix, in prefix tokens: its program loads
# the query tile and attends the chunk's own causal block, and its partials are merged.
# Fitted to three H100 sweeps of 1, 2, 4 (and 8) splits over 4-16K prefixes, on the whole
# GPU (benchmarks/results/extend_waves_h100_{df0a788,4cbad54}.json) and on the prefill
# side of 108- and 84-SM partitions (extend_waves_partitions_h100_f352268.json): from 256
# to 384 tokens the pick is within 0.1% of the fastest count on the whole GPU and 0.5% on
# the partitions (means), where 1,024 (fitted to the whole GPU alone) left 1.8% there,
# up to 22% on 1-tile chunks; held out on 116, 108 and 100 SMs and the whole GPU
# (..._h100_22a09a3.json): 0.2-1.3% and 0.0%.
_SPLIT_OVERHEAD_TOKENS = 320
# Splits only where the cost model gives this share of one split's time or less.
_SPLIT_GAIN = 0.95
_MERGE_TOKENS = 16


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    first_seq: int = 0,
    config: ExtendConfig | None = None,
) -> None:
    """Causal attention of sequences ``first_seq..num_seqs-1`` over cached prefix + new
    tokens; writes their rows of ``out``. The prefix must already be in the cache.

    More than one prefix split (``config.kv_splits``) allocates the partials per call
    (fp32, ``q.shape[0]`` x q heads x splits x head_dim) from torch's caching allocator,
    which orders reuse on the allocating stream: eager steps on several streams (the
    multiplexing lanes) never share them. No CUDA graph captures this function today (a
    decode graph has no extend sequence; piecewise graphs run attention between their
    segments); were it captured, the partials would come from the graph's private pool
    and stay with the graph, and auto splits depend on host ints only."""
    _check_attention_shapes(q, k_cache, v_cache)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_cache.shape[2]
    config = config or default_extend_config(head_dim, q.device)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head_dim axis of k and v must be contiguous")
    if meta.num_seqs <= first_seq or meta.max_query_len <= 0:
        return
    for launch in extend_launches(config, meta, num_q_heads, group, first_seq, q.device):
        _launch_extend(q, k, v, out, k_cache, v_cache, meta, scale, first_seq, config, group,
                       launch)  # fmt: skip


@dataclass(frozen=True)
class ExtendLaunch:
    """One launch of the extend kernel over sequences ``first_seq..``: its grid, prefix
    splits, q heads per tile row block (1, or the GQA group when packed), and the first new
    token of each sequence its tiles start at."""

    grid: tuple[int, int, int]
    splits: int
    row_heads: int
    row_start: int


def _launch_extend(q, k, v, out, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                   first_seq: int, config: ExtendConfig, group: int,
                   launch: ExtendLaunch) -> None:
    """``launch``'s kernel, then with splits its merge, over partials of its own."""
    mid_o, mid_lse, mid_strides = _extend_partials(q, out, launch)
    _extend_kernel[launch.grid](
        q, k, v, out, k_cache, v_cache, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_tables.stride(0),
        *mid_strides,
        scale * math.log2(math.e),
        k_cache.shape[1],
        first_seq,
        launch.row_start,
        GROUP=group,
        ROW_HEADS=launch.row_heads,
        HEAD_DIM=q.shape[2],
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        KV_SPLITS=launch.splits,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    if launch.splits > 1:
        _merge_extend_splits(mid_o, mid_lse, mid_strides, out, meta, first_seq, launch)


def _merge_extend_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, mid_strides: tuple,
                         out: torch.Tensor, meta: AttentionMetadata, first_seq: int,
                         launch: ExtendLaunch) -> None:
    grid = (triton.cdiv(meta.max_query_len - launch.row_start, _MERGE_TOKENS), out.shape[1],
            meta.num_seqs - first_seq)  # fmt: skip
    _extend_merge_kernel[grid](
        mid_o, mid_lse, out, meta.query_start_loc, *mid_strides, out.stride(0), out.stride(1),
        first_seq, launch.row_start, HEAD_DIM=out.shape[2], BLOCK_T=_MERGE_TOKENS,
        KV_SPLITS=launch.splits, num_warps=4 if out.shape[2] >= 128 else 2,
    )  # fmt: skip


def extend_grid(config: ExtendConfig, meta: AttentionMetadata, num_q_heads: int, group: int,
                first_seq: int, device: torch.device) -> tuple[tuple[int, int, int], int]:
    """The extend kernel's grid for sequences ``first_seq..`` of a batch, and its prefix
    split count (``kv_splits`` 0 resolved), as one launch over every tile would run."""
    launch = _one_launch(config, meta.max_query_len, group,
                         _launch_shape(meta, num_q_heads, first_seq, device))
    return launch.grid, launch.splits


def extend_launches(config: ExtendConfig, meta: AttentionMetadata, num_q_heads: int,
                    group: int, first_seq: int, device: torch.device
                    ) -> tuple[ExtendLaunch, ...]:
    """What ``extend_attention`` launches for sequences ``first_seq..`` of a batch."""
    return plan_extend_launches(config, meta.max_query_len, group,
                                _launch_shape(meta, num_q_heads, first_seq, device))


@dataclass(frozen=True)
class LaunchShape:
    """What an extend launch's split count depends on besides its tiles: q heads, sequences,
    the longest cached prefix, and the SMs it runs on (None: the whole device)."""

    num_q_heads: int
    num_seqs: int
    prefix: int
    device: torch.device
    sms: int | None = None


def _launch_shape(meta: AttentionMetadata, num_q_heads: int, first_seq: int,
                  device: torch.device) -> LaunchShape:
    return LaunchShape(num_q_heads, meta.num_seqs - first_seq, extend_prefix_bound(meta),
                       device, meta.launch_sms)  # fmt: skip


@functools.lru_cache(maxsize=1024)  # every layer of a step asks again for the same launches
def plan_extend_launches(config: ExtendConfig, max_query_len: int, group: int,
                         shape: LaunchShape) -> tuple[ExtendLaunch, ...]:
    """One launch over every tile, or with a tail (``_extend_tail``) the whole tiles, then
    the rows past them packed by GQA group, where the split rule's cost model
    (``_split_cost``) gives the two ``_SPLIT_GAIN`` of the one or less: a tail pays where
    the one launch's last tile takes a wave over a long prefix, not over a short one."""
    one = (_one_launch(config, max_query_len, group, shape),)
    row_start = _extend_tail(config, max_query_len, group)
    if row_start is None:
        return one
    tail_tiles = triton.cdiv(max_query_len - row_start, config.block_m // group)
    two = (_extend_launch(config, shape, tail_tiles, group, row_start),)
    if row_start > 0:
        two = (_extend_launch(config, shape, row_start // config.block_m, 1, 0), *two)
    return two if _launches_cost(two, shape) <= _SPLIT_GAIN * _launches_cost(one, shape) \
        else one


def _one_launch(config: ExtendConfig, max_query_len: int, group: int,
                shape: LaunchShape) -> ExtendLaunch:
    """One launch over every query tile of the longest chunk."""
    row_heads = _extend_row_heads(config, group)
    tiles = triton.cdiv(max(max_query_len, 0), config.block_m // row_heads)
    return _extend_launch(config, shape, tiles, row_heads, 0)


def _launches_cost(launches: tuple[ExtendLaunch, ...], shape: LaunchShape) -> float:
    """Launches one after another, in prefix tokens (``_split_cost``)."""
    sms = shape.sms or _sm_count(shape.device)
    return sum(_split_cost(x.splits, x.grid[0] // x.splits * x.grid[1] * x.grid[2],
                           shape.prefix, sms) for x in launches)


def _extend_launch(config: ExtendConfig, shape: LaunchShape, tiles: int, row_heads: int,
                   row_start: int) -> ExtendLaunch:
    """A launch of ``tiles`` query tiles per head slot and sequence, with the split count
    its grid and prefix call for."""
    head_slots = shape.num_q_heads // row_heads
    programs = max(tiles * head_slots * shape.num_seqs, 1)
    splits = extend_kv_splits(config.kv_splits, programs, shape.prefix, shape.device,
                              shape.sms)  # fmt: skip
    return ExtendLaunch((tiles * splits, head_slots, shape.num_seqs), splits, row_heads,
                        row_start)  # fmt: skip


def extend_prefix_bound(meta: AttentionMetadata) -> int:
    """The longest cached prefix the split count may count on: the batch's own figure where
    it has one, else its longest context less its longest query (exact for one sequence)."""
    if meta.max_extend_prefix_len is not None:
        return meta.max_extend_prefix_len
    return max(meta.max_seq_len - meta.max_query_len, 0)


def _extend_row_heads(config: ExtendConfig, group: int) -> int:
    """q heads per tile row block: the whole GQA group when packed, else 1."""
    if not config.pack_gqa:
        return 1
    if config.block_m % group:
        raise ValueError(
            f"pack_gqa needs the GQA group ({group} q heads per kv head) to divide block_m "
            f"({config.block_m}); use pack_gqa=False for this model"
        )
    return group


def _extend_tail(config: ExtendConfig, max_query_len: int, group: int) -> int | None:
    """With ``tail_tiles``: the first row past the longest chunk's whole tiles, where the rows
    after it fill at most half a tile and can be packed by GQA group (``group`` > 1 dividing
    ``block_m``, tiles not packed already); None otherwise (one launch)."""
    rows = max_query_len % config.block_m
    if not config.tail_tiles or config.pack_gqa or group == 1 or config.block_m % group \
            or rows == 0 or 2 * rows > config.block_m:
        return None
    return max_query_len - rows


def extend_kv_splits(requested: int, programs: int, max_prefix_len: int,
                     device: torch.device, sms: int | None = None) -> int:
    """Prefix splits to launch: ``requested`` (a power of two), or for 0 (auto) the power of
    two up to one per ``MIN_EXTEND_SPLIT_TOKENS`` of the longest cached prefix (at most
    ``_MAX_EXTEND_SPLITS``) whose launch takes least by ``_split_cost``, where that is
    ``_SPLIT_GAIN`` of one split's or less.

    One program per SM at the H200's tiles, so a grid runs in whole waves: a 3-tile chunk
    (257-384 tokens, 192 programs with codellama-34b's 64 q heads on 132 SMs) takes two
    waves where a 2-tile one takes one; at 2 splits it runs three waves of half programs.
    In the mixed steps of two LooGLE-like runs at 0c8789f (3,548 steps) attention fitted
    as waves x prefix explained the 3-tile steps' 6.6% excess over a fit linear in the
    chunk. A short chunk over a long prefix (64-128 tokens, under half a wave) runs 2
    splits, one wave, 0.55-0.64x of one split's time on the H100 sweep; 4 (two waves) less
    well. ``sms``: the SMs the launch runs on (an SM partition's), else the device's: on
    108 SMs a 3-tile chunk runs two waves either way, and a split would only add its cost."""
    if requested < 0 or requested & (requested - 1):
        raise ValueError(f"kv_splits must be 0 (auto) or a power of two, got {requested}")
    if requested:
        return requested
    return _auto_splits(programs, max_prefix_len, sms or _sm_count(device))


@functools.lru_cache(maxsize=1024)  # every layer of a step asks again for the same grid
def _auto_splits(programs: int, prefix: int, sms: int) -> int:
    most = min(max(1, prefix // MIN_EXTEND_SPLIT_TOKENS), _MAX_EXTEND_SPLITS)
    counts = [1 << k for k in range(most.bit_length())]  # powers of two up to ``most``
    cost = {splits: _split_cost(splits, programs, prefix, sms) for splits in counts}
    best = min(counts, key=cost.__getitem__)  # the first least: ties go to fewer splits
    return best if cost[best] <= _SPLIT_GAIN * cost[1] else 1


def _split_cost(splits: int, programs: int, prefix: int, sms: int) -> float:
    """A launch's time in prefix tokens: its waves of programs, each a split's share of the
    prefix plus ``_SPLIT_OVERHEAD_TOKENS``."""
    return triton.cdiv(programs * splits, sms) * (_SPLIT_OVERHEAD_TOKENS + prefix / splits)


def _extend_partials(q: torch.Tensor, out: torch.Tensor, launch: ExtendLaunch):
    """Per-launch scratch for the split partials (output rows, their log-sum-exp) and its
    strides: a row per token from ``row_start`` on (a sequence's partials start at its
    first row, so the last one's end ``row_start`` rows before the batch's). One split
    stores straight into ``out`` and never touches them: ``out`` stands in, so the common
    path allocates nothing."""
    if launch.splits == 1:
        return out, out, (0, 0, 0, 0, 0)
    tokens, heads, head_dim = q.shape
    rows, splits = tokens - launch.row_start, launch.splits
    mid_o = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    return mid_o, mid_lse, (*mid_o.stride()[:3], *mid_lse.stride()[:2])


def default_extend_config(head_dim: int, device: torch.device,
                          hopper: bool | None = None) -> ExtendConfig:
    """``hopper``: whether the tiles may use Hopper's shared memory (None: ask the device).
    On a GPU the prefix splits follow ``PDSERVE_EXTEND_KV_SPLITS`` (default 0: the rule of
    ``extend_kv_splits``; a power of two fixes them) and the tail launch
    ``PDSERVE_EXTEND_TAIL_TILES`` (default 1: on; 0: off)."""
    if device.type != "cuda":  # interpreter: small tiles, several of them per sequence
        return ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    splits, tail = _extend_splits_from_env(), _extend_tail_from_env()
    if head_dim <= 64:
        return ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=3,
                            kv_splits=splits, tail_tiles=tail)
    if hopper is None:
        hopper = torch.cuda.get_device_capability(device) >= (9, 0)
    if head_dim <= 128 and hopper:
        # Q 32 KiB + 3 stages of 128-token K and V tiles (32 KiB each): 224 of Hopper's
        # 227 KiB. On the H200 (codellama-34b heads) the fastest of 12 tile configs for a
        # whole 8K prompt (+2% over 64-token tiles) and by far for chunks over a cached
        # prefix (+12% at 2K over 16K, +17% at 512 over 8K; benchmarks/results/extend_sweep_*).
        return ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=3,
                            kv_splits=splits, tail_tiles=tail)
    if head_dim <= 128:
        # Q 32 KiB + 3 stages of K and V tiles (16 KiB each) stays inside 164 KiB smem.
        return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3,
                            kv_splits=splits, tail_tiles=tail)
    return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, kv_splits=splits,
                        tail_tiles=tail)


@functools.cache
def _extend_tail_from_env() -> bool:
    raw = os.environ.get(EXTEND_TAIL_ENV, "1")
    if raw not in ("0", "1"):
        raise ValueError(f"{EXTEND_TAIL_ENV}={raw!r}: must be 0 or 1")
    return raw == "1"


@functools.cache
def _extend_splits_from_env() -> int:
    raw = os.environ.get(EXTEND_SPLITS_ENV, "0")
    try:
        splits = int(raw)
    except ValueError:
        splits = -1
    if splits < 0 or splits & (splits - 1):
        raise ValueError(f"{EXTEND_SPLITS_ENV}={raw!r}: must be 0 (auto) or a power of two")
    return splits


def _check_attention_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads {q.shape[1]} not a multiple of kv heads {k_cache.shape[2]}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis must be contiguous")


# --------------------------------------------------------------------------- backend


class TritonAttentionBackend:
    """Stores the step's K/V into the paged cache, then runs split-KV decode on the decode
    sequences and the causal extend kernel on the rest (sequences are decode-first).

    ``max_kv_splits`` bounds the decode split count; the count actually launched depends
    only on the decode batch size (a host int), so each CUDA-graph batch bucket has a fixed
    grid. Contexts shorter than ``num_splits * min_split_tokens`` leave splits empty.

    ``balance_splits`` (default ``PDSERVE_DECODE_BALANCE_SPLITS``, else 8; 1 turns it off)
    launches up to that many splits at every batch size (``num_kv_splits``), used by
    contexts longer than their share of the batch's tokens: with the count from the batch
    size alone, from 33 decodes on (codellama-34b's 8 KV heads on 132 SMs) each context had
    one program, and a batch's longest context set the time of every layer (on the H200 at
    3bf43d0, one 8K context beside 47 of 512 tokens: 287 us a layer, 67 balanced).

    ``min_split_tokens`` is 64 (one K/V tile of 64): at small batches a split is a chain of
    dependent loads per tile, so one tile per split is the shortest. On the H200 at 38d366f
    (two launches, ``bench_kernels.py --decode-ab``,
    ``benchmarks/results/kernels_decode_ab_h200_38d366f.json``) 64 against 128 took 8.1 /
    10.1 / 11.8 / 16.2 us per layer at batch 1 / 2 / 4 / 8 and 1K context against 9.9 /
    10.9 / 13.1 / 16.4 (llama3-8b heads; codellama-34b's alike), and the same at 4K.

    ``fuse_rope`` (default on; ``PDSERVE_FUSED_ROPE_DECODE=0`` turns it off) folds the
    rotary embedding and K/V store into the decode kernel of decode-only batches.
    """

    name = "triton"

    def __init__(
        self,
        max_kv_splits: int = 32,
        min_split_tokens: int = 64,
        num_sms: int | None = None,
        fuse_rope: bool | None = None,
        balance_splits: int | None = None,
    ) -> None:
        if balance_splits is None:
            balance_splits = int(os.environ.get(BALANCE_SPLITS_ENV, "8"))
        for name, value in (("max_kv_splits", max_kv_splits), ("balance_splits", balance_splits)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        self.max_kv_splits = max_kv_splits
        self.balance_splits = min(balance_splits, max_kv_splits)
        self._splitting: dict[tuple, tuple[int, int, int]] = {}
        self.min_split_tokens = min_split_tokens
        self.num_sms = num_sms
        if fuse_rope is None:
            fuse_rope = os.environ.get(FUSED_ROPE_DECODE_ENV, "1") not in ("", "0")
        self.fuse_rope = fuse_rope

    def fuses_rope(self, meta: AttentionMetadata) -> bool:
        """Whether ``rope_store_attend`` serves this batch: a decode-only one, when enabled.
        Host ints only, so a captured decode graph keeps the path it recorded."""
        return self.fuse_rope and meta.num_seqs == meta.num_decode_seqs > 0

    def rope_store_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
        """``rope_store_kv`` then ``attend`` as one decode kernel, for a batch that
        ``fuses_rope``; q, k and v arrive unrotated and stay so."""
        if not self.fuses_rope(meta):
            raise ValueError("rope_store_attend serves decode-only batches with fuse_rope on")
        out = torch.empty_like(q)
        self._decode(q, k_cache, v_cache, meta, meta.num_seqs, out, scale,
                     NewTokenRope(k, v, positions, cos_sin_cache, meta.slot_mapping))
        return out

    def even_kv_splits(self, num_decode_seqs: int, num_kv_heads: int,
                       device: torch.device) -> int:
        """Splits of each context when all are alike: enough programs for about two per SM
        (``_programs``), no more."""
        wanted = triton.cdiv(self._programs(device), max(1, num_decode_seqs * num_kv_heads))
        return min(self.max_kv_splits, triton.next_power_of_2(wanted))

    def num_kv_splits(self, num_decode_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """Splits the decode kernel launches per context: the even count, and up to
        ``balance_splits`` for long contexts beside short ones, as many as keep the
        partial results within ``BALANCE_PROGRAMS_PER_SM`` programs per SM."""
        return self.decode_splitting(num_decode_seqs, num_kv_heads, device)["num_splits"]

    def decode_variant(self, num_decode_seqs: int, num_kv_heads: int,
                       device: torch.device) -> tuple[int, int]:
        """What picks the decode kernel's compiled variant at this batch size: the split
        count, and the width of the lengths a balanced launch loads (0 unbalanced). A
        warm-up that runs one batch of each compiles every variant serving can meet."""
        splitting = self.decode_splitting(num_decode_seqs, num_kv_heads, device)
        balanced = splitting["balance_programs"] > 0
        return splitting["num_splits"], balance_width(num_decode_seqs) if balanced else 0

    def _programs(self, device: torch.device) -> int:
        return 2 * (self.num_sms or _sm_count(device))

    def decode_splitting(self, num_decode_seqs: int, num_kv_heads: int,
                         device: torch.device) -> dict[str, int]:
        """``decode_attention``'s split arguments for a decode batch of this size (worked
        out once per size: every layer of an eager step asks). Where no context may take
        splits beyond the even count, balancing could add none: it is off (the kernel then
        skips the batch's token sum)."""
        key = (num_decode_seqs, num_kv_heads, device)
        if key not in self._splitting:
            cap = self.even_kv_splits(num_decode_seqs, num_kv_heads, device)
            room = (BALANCE_PROGRAMS_PER_SM * (self.num_sms or _sm_count(device))
                    // max(1, num_decode_seqs * num_kv_heads))
            splits = max(cap, min(self.balance_splits, 1 << max(0, room.bit_length() - 1)))
            balanced = splits > cap and num_decode_seqs <= BALANCE_MAX_SEQS
            self._splitting[key] = (splits, cap, self._programs(device) if balanced else 0)
        splits, cap, balance_programs = self._splitting[key]
        return {"num_splits": splits, "min_split_tokens": self.min_split_tokens,
                "split_cap": cap, "balance_programs": balance_programs}

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, num_decode: int, out: torch.Tensor, scale: float,
                rope: NewTokenRope | None = None) -> None:
        decode_attention(
            q, k_cache, v_cache, meta.block_tables[:num_decode], meta.seq_lens[:num_decode],
            out, scale, rope=rope,
            **self.decode_splitting(num_decode, k_cache.shape[2], q.device),
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K/V."""
        out = torch.empty_like(q)
        num_decode = meta.num_decode_seqs
        if num_decode > 0:
            self._decode(q, k_cache, v_cache, meta, num_decode, out, scale)
        if meta.num_seqs > num_decode:
            extend_attention(q, k, v, out, k_cache, v_cache, meta, scale, first_seq=num_decode)
        return out


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: any fixed number works
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
