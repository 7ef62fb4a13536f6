from __future__ import annotations

from pdserve.cache.block_manager import BlockManager
from tests.engine.factories import make_request


def _compute_all(blocks: BlockManager, request) -> None:
    """Admits ``request`` and marks its whole prompt computed, as a finished prefill would."""
    blocks.admit(request)
    blocks.grow(request, request.num_tokens)
    request.num_computed = request.num_tokens
    blocks.commit(request)


def test_grow_allocates_whole_blocks_and_free_returns_them():
    blocks = BlockManager(num_blocks=8, block_size=4)
    request = make_request(9)
    assert blocks.grow(request, 9)
    assert len(request.block_ids) == 3 and blocks.num_free_blocks == 5
    assert not blocks.grow(make_request(40), 40), "needs 10 blocks, 5 free"
    blocks.free(request)
    assert blocks.num_free_blocks == 8
    blocks.check_integrity([])


def test_prefix_hit_shares_blocks_with_ref_counts():
    blocks = BlockManager(num_blocks=16, block_size=4)
    first, second = make_request(10), make_request(10)
    _compute_all(blocks, first)
    blocks.admit(second)
    assert second.num_computed == 8  # two full blocks; the partial third is not shared
    assert second.block_ids == first.block_ids[:2]
    assert blocks.blocks[first.block_ids[0]].ref_count == 2
    blocks.check_integrity([first, second])
    blocks.free(first)
    blocks.free(second)
    blocks.check_integrity([])


def test_whole_prompt_hit_still_recomputes_last_token():
    blocks = BlockManager(num_blocks=16, block_size=4)
    first, second = make_request(8), make_request(8)
    _compute_all(blocks, first)
    blocks.free(first)
    blocks.admit(second)
    assert second.num_computed == 4, "the last prompt token must run to give logits"


def test_freed_cached_blocks_are_hits_until_recycled():
    blocks = BlockManager(num_blocks=4, block_size=4)
    first = make_request(8)
    _compute_all(blocks, first)
    blocks.free(first)
    other = make_request(16, first_token=100)
    blocks.admit(other)
    assert other.num_computed == 0
    assert blocks.grow(other, 16), "cached-but-free blocks are recycled under pressure"
    assert not blocks.cached, "recycled blocks forget their hashes"
    blocks.check_integrity([other])


def test_different_tokens_do_not_hit():
    blocks = BlockManager(num_blocks=16, block_size=4)
    first, second = make_request(9, first_token=10), make_request(9, first_token=11)
    _compute_all(blocks, first)
    blocks.admit(second)
    assert second.num_computed == 0


def test_block_table_row_is_rewritten_after_preemption():
    from pdserve.engine.batch import BlockTables

    tables = BlockTables(max_blocks_per_seq=8)
    request = make_request(12)
    request.block_ids = [5, 6, 7]
    assert tables.row(request)[:3].tolist() == [5, 6, 7]
    # Re-admitted after preemption with other pages but the same last one at index 2.
    request.num_preemptions += 1
    request.block_ids = [1, 2, 7]
    assert tables.row(request)[:3].tolist() == [1, 2, 7]
    request.block_ids = [1, 2, 7, 9]
    assert tables.row(request)[:4].tolist() == [1, 2, 7, 9]


def test_reset_prefix_cache_forgets_free_blocks_and_keeps_those_in_use():
    blocks = BlockManager(num_blocks=16, block_size=4)
    running, finished = make_request(8), make_request(8, first_token=100)
    _compute_all(blocks, running)
    _compute_all(blocks, finished)
    blocks.free(finished)
    assert blocks.reset_prefix_cache() == (2, 2)  # finished's two forgotten, running's kept
    again = make_request(8, first_token=100)
    blocks.admit(again)
    assert again.num_computed == 0, "a forgotten prefix is no hit"
    same = make_request(8)
    blocks.admit(same)
    assert same.num_computed == 4, "a running request's blocks are still shared"
    blocks.check_integrity([running, again, same])
    for request in (running, again, same):
        blocks.free(request)
    assert blocks.reset_prefix_cache() == (2, 0)
    assert not blocks.cached
    blocks.check_integrity([])
