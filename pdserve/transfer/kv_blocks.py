"""Block-free KV transfer (P/D-Serve): gather a request's scattered pages into one buffer,
scatter it back into the receiver's own pages.

Buffer layout: ``[num_layers, 2, num_tokens, kv_heads, head_dim]``, K at index 0 and V at
index 1, token ``t`` at row ``t`` (position ``t`` of the request). Only the tokens that carry
KV travel: a partial last page sends its ``num_tokens % block_size`` rows, not a whole page.
The layout does not depend on the page size or page ids, so sender and receiver may use
different pools, different ids and even different block sizes.

Copies: pools made by ``allocate_kv_pool`` are one tensor, so every layer's K and V pages are
a single strided view and a transfer is one ``index_select`` / ``index_copy_`` over whole
pages for all layers, plus one for the used rows of a partial last page. Whole pages move as
contiguous runs (on a CPU, a copy indexed per token was 15x slower for the same bytes). Any
other pool falls back to a per-token index, two kernels per layer (K and V). A gathered CPU
buffer (and a received one, ``tcp.py``) comes from ``host_empty``: memory of earlier buffers,
already faulted in, since faulting in fresh pages cost as much as the copy itself.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence

import torch

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer [pages, block, heads, dim]
# CPU transfer buffers from this size up come from HOST_POOL (see host_empty), which keeps
# at most this many bytes of idle buffers resident (two 4096-token llama3-8b buffers).
HOST_POOL_MIN_BYTES = 4 << 20
HOST_POOL_MAX_IDLE_BYTES = 1 << 30


def token_slots(block_ids: Sequence[int], block_size: int, num_tokens: int,
                device: torch.device) -> torch.Tensor:
    """Flat page-slot index of tokens 0..num_tokens-1 held in ``block_ids`` (in order)."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} pages of {block_size}")
    blocks = torch.tensor(list(block_ids), dtype=torch.int64)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:num_tokens]
    if device.type == "cuda":
        # From pageable memory the copy would wait for the stream to drain (e.g. behind a
        # decode step in flight); pinned, it is queued and the host moves on.
        slots = slots.pin_memory()
    return slots.to(device, non_blocking=True)


def _check_fits(block_ids: Sequence[int], block_size: int, num_tokens: int) -> None:
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} pages of {block_size}")


def _page_runs(whole: torch.Tensor, buffer: torch.Tensor, block_ids: Sequence[int],
               num_tokens: int, block: int):
    """(pool pages, buffer rows, page ids) pairs that cover the request: its full pages in
    one go, then the used rows of a partial last page. Whole pages move as contiguous
    ``block * heads * dim`` runs; a copy indexed per token is several times slower on CPUs."""
    pages = whole.unflatten(2, (-1, block))  # [layers, 2, pages, block, heads, dim]
    full, tail = divmod(num_tokens, block)
    ids = _device_ids(block_ids[: full + (1 if tail else 0)], whole.device)
    if full:
        yield pages, buffer[:, :, : full * block].unflatten(2, (full, block)), ids[:full]
    if tail:
        # The last page's first ``tail`` rows, seen as a pool of one-row-group pages.
        yield (pages[:, :, :, :tail], buffer[:, :, full * block :].unsqueeze(2),
               ids[full:])


def _device_ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type == "cuda":
        ids = ids.pin_memory()  # queued copy, no wait for the stream to drain
    return ids.to(device, non_blocking=True)


def transfer_shape(kv_caches: KVCaches, num_tokens: int) -> tuple[int, ...]:
    k_pages = kv_caches[0][0]
    return (len(kv_caches), 2, num_tokens, k_pages.shape[2], k_pages.shape[3])


def gather_blocks(kv_caches: KVCaches, block_ids: Sequence[int], num_tokens: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """All layers' K and V of a request's first ``num_tokens`` tokens, contiguous, in the
    module's layout. ``out`` may be a preallocated buffer of that shape (e.g. pinned or
    registered memory); the copy runs on the current stream. Without ``out``, a CPU buffer
    comes from ``host_empty`` (reused, already faulted-in memory when big)."""
    k_pages = kv_caches[0][0]
    shape = transfer_shape(kv_caches, num_tokens)
    if out is None:
        out = (host_empty(shape, k_pages.dtype) if k_pages.device.type == "cpu"
               else torch.empty(shape, dtype=k_pages.dtype, device=k_pages.device))
    elif tuple(out.shape) != shape:
        raise ValueError(f"buffer shape {tuple(out.shape)} is not {shape}")
    whole = flat_pool_view(kv_caches)
    if whole is not None:
        _check_fits(block_ids, k_pages.shape[1], num_tokens)
        for pool, rows, page_ids in _page_runs(whole, out, block_ids, num_tokens,
                                                   k_pages.shape[1]):
            torch.index_select(pool, 2, page_ids, out=rows)
        return out
    slots = token_slots(block_ids, k_pages.shape[1], num_tokens, k_pages.device)
    for layer, pages in enumerate(kv_caches):
        for kind in (0, 1):
            torch.index_select(pages[kind].flatten(0, 1), 0, slots, out=out[layer, kind])
    return out


def scatter_blocks(buffer: torch.Tensor, kv_caches: KVCaches, block_ids: Sequence[int]) -> None:
    """RecvScatter: writes a gathered buffer into the receiver's pages ``block_ids``
    (its own ids, its own pool); rows past the buffer's tokens are left untouched."""
    k_pages = kv_caches[0][0]
    expected = transfer_shape(kv_caches, buffer.shape[2])
    if tuple(buffer.shape) != expected:
        raise ValueError(f"buffer shape {tuple(buffer.shape)} does not fit this pool {expected}")
    buffer = buffer.to(device=k_pages.device, dtype=k_pages.dtype, non_blocking=True)
    whole = flat_pool_view(kv_caches)
    if whole is not None:
        _check_fits(block_ids, k_pages.shape[1], buffer.shape[2])
        for pool, rows, page_ids in _page_runs(whole, buffer, block_ids, buffer.shape[2],
                                                   k_pages.shape[1]):
            pool.index_copy_(2, page_ids, rows)
        return
    slots = token_slots(block_ids, k_pages.shape[1], buffer.shape[2], k_pages.device)
    for layer, pages in enumerate(kv_caches):
        for kind in (0, 1):
            pages[kind].view(-1, *pages[kind].shape[2:]).index_copy_(0, slots,
                                                                     buffer[layer, kind])


def flat_pool_view(kv_caches: KVCaches) -> torch.Tensor | None:
    """``[layers, 2, pages * block_size, heads, dim]`` over the pool's own memory, when every
    layer's K and V pages sit in one storage at uniform strides (``allocate_kv_pool``, and
    page ranges of it); None otherwise."""
    k0, v0 = kv_caches[0]
    if not (k0.is_contiguous() and v0.is_contiguous()):
        return None
    base = k0.storage_offset()
    kv_stride = v0.storage_offset() - base
    layer_stride = kv_caches[1][0].storage_offset() - base if len(kv_caches) > 1 else 0
    if kv_stride <= 0 or (len(kv_caches) > 1 and layer_stride <= 0):
        return None  # as_strided needs positive strides
    storage = k0.untyped_storage().data_ptr()
    for layer, (k, v) in enumerate(kv_caches):
        same = (k.shape == k0.shape and v.shape == k0.shape and k.stride() == k0.stride()
                and v.stride() == k0.stride()
                and k.untyped_storage().data_ptr() == storage
                and v.untyped_storage().data_ptr() == storage
                and k.storage_offset() == base + layer * layer_stride
                and v.storage_offset() == base + layer * layer_stride + kv_stride)
        if not same:
            return None
    pages, block, heads, dim = k0.shape
    shape = (len(kv_caches), 2, pages * block, heads, dim)
    stride = (layer_stride, kv_stride, heads * dim, dim, 1)
    return k0.as_strided(shape, stride, base)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor for a transfer buffer (a gather's output, a
    received message), from memory that is already faulted in when there is some.

    ``torch.empty`` of a few MB up is a fresh mapping each time (glibc unmaps big blocks on
    free), faulted in page by page by whatever first writes it: a gather into it, or the
    kernel inside ``recv_into``. Measured on the CPU host, that cost as much as the copy
    itself (128 MiB: a gather 80 ms into fresh memory, 19 ms into touched memory; a
    loopback receive ~0.5 GB/s into fresh memory, 1.3-1.9 GB/s into touched memory).

    From ``HOST_POOL_MIN_BYTES`` up the tensor is a view of an anonymous mapping taken from
    ``HOST_POOL``: when the last tensor using it is freed, the mapping goes back there,
    pages and all, for the next buffer of about its size. (Advising fresh mappings
    ``MADV_HUGEPAGE`` instead was faster in a tight loop but slower than plain pages at
    the benchmark's pace on the CPU host, a VM that hands free memory back to its host.)
    The storage is not resizable. Smaller buffers, and platforms without anonymous
    ``mmap``, get ``torch.empty``.
    """
    count = math.prod(shape)
    num_bytes = count * dtype.itemsize
    if num_bytes < HOST_POOL_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(shape, dtype=dtype)
    return HOST_POOL.tensor(count, dtype).view(shape)


class HostBufferPool:
    """Anonymous mappings kept resident for reuse once the tensors viewing them are gone.

    Idle mappings are kept up to ``max_idle_bytes`` in all (the oldest unmapped first); a
    request takes the smallest idle mapping of between 1x and 2x its size, else a new one.
    A mapping is returned by a finalizer on the memoryview that ``torch.frombuffer`` holds,
    so it comes back only when no tensor can still reach it, from whichever thread freed
    the last one.
    """

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.RLock()  # reentrant: a finalizer may run inside a locked call
        self._idle: list[mmap.mmap] = []  # oldest first
        self.hits = self.misses = 0

    def tensor(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``count`` elements over a pooled mapping."""
        region = self._take(count * dtype.itemsize)
        view = memoryview(region)
        weakref.finalize(view, self._give_back, region).atexit = False
        return torch.frombuffer(view, dtype=dtype, count=count)

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(region) for region in self._idle)

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for region in idle:
            region.close()

    def _take(self, num_bytes: int) -> mmap.mmap:
        with self._lock:
            fits = [r for r in self._idle if num_bytes <= len(r) <= 2 * num_bytes]
            if fits:
                region = min(fits, key=len)
                self._idle = [r for r in self._idle if r is not region]
                self.hits += 1
                return region
            self.misses += 1
        # Pages are faulted in as they are first written, so a header that lies about its
        # size costs only what its sender really sends.
        return mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def _give_back(self, region: mmap.mmap) -> None:
        if len(region) > self.max_idle_bytes:
            region.close()  # over the whole budget: not worth evicting everything else for
            return
        evicted = []
        with self._lock:
            self._idle.append(region)
            while sum(len(r) for r in self._idle) > self.max_idle_bytes:
                evicted.append(self._idle.pop(0))
        for old in evicted:
            old.close()

    def _after_fork(self) -> None:
        self._lock = threading.RLock()  # a thread that held it is gone in the child


HOST_POOL = HostBufferPool(HOST_POOL_MAX_IDLE_BYTES)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=HOST_POOL._after_fork)
