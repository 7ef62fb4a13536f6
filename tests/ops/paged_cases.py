"""Random paged-attention batches for comparing attention backends (shared by the tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.ops.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    num_real_tokens: int  # rows of q that belong to a sequence (padding rows follow)


def make_paged_batch(
    decode_lens: list[int],
    extend: list[tuple[int, int]],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    pad_decode: int = 0,
    seed: int = 0,
    table_width: int | None = None,
    num_pages: int | None = None,
) -> PagedBatch:
    """Decode sequences with context lengths ``decode_lens`` (one new token each), then
    extend sequences given as (cached prefix, new tokens). A pure decode batch may end with
    ``pad_decode`` padding sequences (slot -1, context 0 or 1, block table of zeros), as a
    CUDA-graph batch bucket has. ``table_width``/``num_pages`` fix the block-table and
    cache shapes (for replaying one CUDA graph on several batches).

    Pages are handed out in a random order so no sequence's pages are contiguous, page 0
    is never handed out, and the whole cache starts as random values, so reading a wrong
    slot shows up as a mismatch.
    """
    if pad_decode and extend:
        raise ValueError("padding sequences belong to pure decode batches")
    gen = torch.Generator().manual_seed(seed)
    seqs = [(n - 1, 1) for n in decode_lens] + list(extend)
    pages_per_seq = [-(-(p + n) // page_size) for p, n in seqs]
    max_pages = table_width or max(pages_per_seq + [1])
    num_pages = num_pages or sum(pages_per_seq) + 1 + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs) + pad_decode, max_pages, dtype=torch.int32)
    slots: list[int] = []
    for i, ((prefix, new), n_pages) in enumerate(zip(seqs, pages_per_seq, strict=True)):
        tables[i, :n_pages] = torch.tensor(perm[:n_pages], dtype=torch.int32)
        perm = perm[n_pages:]
        for pos in range(prefix, prefix + new):
            slots.append(int(tables[i, pos // page_size]) * page_size + pos % page_size)
    num_real = len(slots)
    slots += [-1] * pad_decode
    seq_lens = [p + n for p, n in seqs] + [i % 2 for i in range(pad_decode)]
    new_counts = [n for _, n in seqs] + [1] * pad_decode
    num_decode = len(decode_lens) + pad_decode
    meta = _metadata(new_counts, seq_lens, tables, slots, num_decode, page_size, device)
    tokens = len(slots)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return PagedBatch(
        q=rand(tokens, q_heads, head_dim),
        k=rand(tokens, kv_heads, head_dim),
        v=rand(tokens, kv_heads, head_dim),
        k_cache=rand(num_pages, page_size, kv_heads, head_dim),
        v_cache=rand(num_pages, page_size, kv_heads, head_dim),
        meta=meta,
        num_real_tokens=num_real + pad_decode,
    )


def _metadata(new_counts, seq_lens, tables, slots, num_decode, page_size, device):
    starts = torch.zeros(len(new_counts) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(new_counts, dtype=torch.int32).cumsum(0)
    return AttentionMetadata(
        num_seqs=len(new_counts),
        num_decode_seqs=num_decode,
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(new_counts),
        max_seq_len=max(seq_lens),
        block_size=page_size,
    )


def run_both(batch: PagedBatch, backend, reference, scale: float):
    """Runs both backends on separate copies of the cache; returns (out, ref, caches)."""
    caches = [(batch.k_cache.clone(), batch.v_cache.clone()) for _ in range(2)]
    out = backend.forward(batch.q, batch.k, batch.v, *caches[0], batch.meta, scale)
    ref = reference.forward(batch.q, batch.k, batch.v, *caches[1], batch.meta, scale)
    return out, ref, caches
