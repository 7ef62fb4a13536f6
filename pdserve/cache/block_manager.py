"""Paged KV blocks: ref counts, a free queue, and prefix caching by hash chain.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal
prefixes. Freed blocks keep their hash while they wait in the free queue: a later request
with the same prefix takes them back (a hit) until allocation recycles them, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = eviction order: the longest-free block is recycled first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admit(self, request: Request, use_cache: bool = True) -> None:
        """Gives a waiting request its cached prefix blocks (hits never need free blocks).

        Sets ``num_computed`` to the number of cached tokens. At least the last prompt token
        is always recomputed: its logits pick the first output token. ``use_cache`` False:
        no lookup (the request needs every position's logits); it still publishes its own.
        """
        hits = self._lookup_prefix(request) if use_cache else []
        for block_id in hits:
            self._take(block_id)
        request.block_ids = hits
        request.num_committed_blocks = len(hits)
        request.num_computed = len(hits) * self.block_size
        request.num_cached_tokens = request.num_computed
        self.prefix_queries += request.num_tokens
        self.prefix_hits += request.num_computed

    def _lookup_prefix(self, request: Request) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        hashes = self._hash_chain(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != self._tokens_of(request, i):
                break
            hits.append(block_id)
        return hits

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Makes room for ``num_tokens`` tokens in the request's blocks; False if out of blocks."""
        missing = self.blocks_needed(num_tokens) - len(request.block_ids)
        if missing <= 0:
            return True  # most decode steps: the last block still has room
        if missing > len(self.free_blocks):
            return False
        for _ in range(missing):
            request.block_ids.append(self._take_fresh())
        return True

    def commit(self, request: Request, num_written: int | None = None) -> None:
        """Registers hashes of the request's blocks that became full and computed (of its
        first ``num_written`` tokens, when some computed ones are still being written)."""
        if not self.enable_prefix_caching:
            return
        written = request.num_computed if num_written is None else num_written
        num_full = written // self.block_size
        if num_full <= request.num_committed_blocks:
            return  # the common decode step: nothing new, O(1)
        hashes = self._hash_chain(request)
        for i in range(request.num_committed_blocks, min(len(hashes), num_full)):
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                block.token_ids = self._tokens_of(request, i)
                self.cached[hashes[i]] = block.block_id
        request.num_committed_blocks = num_full

    def free(self, request: Request) -> None:
        # Tail blocks first: they are the least likely to be shared, so they are recycled first.
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        request.block_ids = []
        request.num_committed_blocks = 0

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forgets the contents of every cached block no request holds, so no later prompt
        hits them (benchmark runs that must not share a prefix, vLLM's and SGLang's cache
        reset). Blocks in use keep theirs: they are live, and what they hold is right.
        Returns (blocks forgotten, cached blocks kept because in use)."""
        forgotten = 0
        for block_id in self.free_blocks:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
                forgotten += 1
        return forgotten, len(self.cached)

    def _take(self, block_id: int) -> int:
        """Adds a reference to a block, keeping its contents (a prefix hit)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1
        return block_id

    def _take_fresh(self) -> int:
        """Recycles the longest-free block; its old contents are forgotten."""
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _hash_chain(self, request: Request) -> list[int]:
        hashes = request.block_hashes
        for i in range(len(hashes), len(request.token_ids) // self.block_size):  # known ones
            parent = hashes[i - 1] if i else 0
            hashes.append(hash((parent, self._tokens_of(request, i))))
        return hashes

    def _tokens_of(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.token_ids[start : start + self.block_size])

    def check_integrity(self, live_requests: list[Request]) -> None:
        """Asserts ref counts match live requests and free/used blocks partition the pool."""
        refs = [0] * self.num_blocks
        for request in live_requests:
            for block_id in request.block_ids:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} refs"
            assert (block.ref_count == 0) == (block.block_id in self.free_blocks)
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, "stale hash entry"
