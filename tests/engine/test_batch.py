"""Host batches built from block tables kept between steps, checked against a rebuild from
scratch every step while the batch changes: requests join, finish, are preempted and come
back with other pages, and table rows are reused."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.engine.batch import BlockTables, build_host_batch
from pdserve.sched.base import Plan
from tests.engine.factories import fake_output, make_request, make_scheduler_for

BLOCK_SIZE = 4
WIDTH = 16  # pages per row: 64 tokens, more than any request below reaches


def reference_batch(plan: Plan) -> dict[str, np.ndarray]:
    """The batch written out token by token from the requests themselves."""
    input_ids, positions, slots, starts, seq_lens, logits, rows = [], [], [], [0], [], [], []
    for item in plan.scheduled:
        request = item.request
        end = request.num_computed + item.num_new_tokens
        for pos in range(request.num_computed, end):
            input_ids.append(request.token_ids[pos])
            positions.append(pos)
            slots.append(request.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + item.num_new_tokens)
        seq_lens.append(end)
        if item.samples:
            logits.append(starts[-1] - 1)
        rows.append(request.block_ids + [0] * (WIDTH - len(request.block_ids)))
    max_blocks = -(-max(seq_lens) // BLOCK_SIZE)
    max_blocks = -(-max_blocks // 16) * 16  # rounded up to 16 pages: one kernel specialisation
    return {"input_ids": np.array(input_ids, np.int64), "positions": np.array(positions, np.int64),
            "slot_mapping": np.array(slots, np.int64),
            "query_start_loc": np.array(starts, np.int32),
            "seq_lens": np.array(seq_lens, np.int32),
            "block_tables": np.array(rows, np.int32)[:, :max_blocks],
            "logits_indices": np.array(logits, np.int64)}


def assert_matches_reference(batch, plan: Plan) -> None:
    for name, expected in reference_batch(plan).items():
        got = getattr(batch, name)
        assert got.dtype == expected.dtype, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
    assert batch.block_tables.flags.c_contiguous
    assert batch.num_decode_seqs == len(plan.decodes)
    extends = plan.scheduled[len(plan.decodes):]
    assert batch.max_extend_prefix_len() == max(
        (item.request.num_computed for item in extends), default=0)


@pytest.mark.parametrize("schedule", ["chunked", "prefill-first"])
def test_host_batch_matches_rebuild_while_batch_changes(schedule):
    # 60 requests through a 64-page pool: preemptions, requests finishing mid-batch, rows
    # freed and reused, and more than 16 rows live at once (the table grows).
    rng = random.Random(0)
    sched = make_scheduler_for(schedule, num_blocks=64, block_size=BLOCK_SIZE, chunk_size=32,
                               max_num_batched_tokens=32, max_num_seqs=64)
    tables = BlockTables(WIDTH)
    pending = [make_request(rng.randint(1, 12), max_tokens=rng.randint(1, 40),
                            first_token=rng.randint(3, 500)) for _ in range(60)]
    steps = finished = 0
    most_rows = 0
    while (pending or sched.has_work()) and steps < 2000:
        for _ in range(min(rng.randint(0, 6), len(pending))):
            sched.add(pending.pop())
        plan = sched.plan_step()
        steps += 1
        if plan.is_empty():
            continue
        assert_matches_reference(build_host_batch(plan, tables, BLOCK_SIZE), plan)
        most_rows = max(most_rows, len(tables._rows))
        for request in sched.update(plan, fake_output(plan)):
            tables.drop(request.request_id)  # as EngineCore._forget does
            finished += 1
    assert not pending and not sched.has_work() and finished == 60
    assert sched.num_preemptions > 0, "the scenario must preempt to test row rewrites"
    assert most_rows > 16 and len(tables.table) > 16, "the table must have grown"


def test_reused_row_holds_no_pages_of_its_previous_owner():
    tables = BlockTables(max_blocks_per_seq=8)
    first = make_request(16)
    first.block_ids = [5, 6, 7, 8]
    row_of_first = tables.row_indices([first])[0]
    tables.drop(first.request_id)
    second = make_request(4)
    second.block_ids = [3]
    assert tables.row_indices([second])[0] == row_of_first
    assert tables.row(second).tolist() == [3] + [0] * 15  # 8 pages, padded to 16


def test_row_rewritten_after_preemption_is_padded_with_page_zero():
    tables = BlockTables(max_blocks_per_seq=6)
    request = make_request(16)
    request.block_ids = [5, 6, 7, 8]
    assert tables.row(request).tolist() == [5, 6, 7, 8] + [0] * 12
    request.num_preemptions += 1  # re-admitted with fewer, other pages
    request.block_ids = [1, 2]
    assert tables.row(request).tolist() == [1, 2] + [0] * 14
    request.block_ids.append(9)  # grows again: only the new page is written
    assert tables.row(request).tolist() == [1, 2, 9] + [0] * 13


def test_block_tables_are_copies_not_views_of_the_table():
    # A multiplex prefill batch keeps its HostBatch across later builds of other batches.
    tables = BlockTables(max_blocks_per_seq=4)
    request = make_request(8)
    request.block_ids = [1, 2]
    sched_plan = Plan()
    sched_plan.add(request, 8)
    batch = build_host_batch(sched_plan, tables, BLOCK_SIZE)
    request.num_preemptions += 1
    request.block_ids = [3, 4]
    tables.row_indices([request])
    assert batch.block_tables.tolist() == [[1, 2] + [0] * 14]


@pytest.mark.parametrize("pages, width", [(1, 16), (15, 16), (16, 16), (17, 32), (40, 48)])
def test_step_tables_are_a_multiple_of_16_pages_wide_whatever_the_longest_sequence(pages, width):
    # Triton specialises the attention kernels on the row stride (1, a multiple of 16, or
    # neither): a width that followed the batch compiled variants inside serving steps.
    tables = BlockTables(max_blocks_per_seq=40)
    assert tables.width == 48
    request = make_request(pages * BLOCK_SIZE)
    request.block_ids = list(range(1, pages + 1))
    plan = Plan()
    plan.add(request, pages * BLOCK_SIZE)
    batch = build_host_batch(plan, tables, BLOCK_SIZE)
    assert batch.block_tables.shape == (1, width)
    assert batch.block_tables[0, :pages].tolist() == request.block_ids
    assert not batch.block_tables[0, pages:].any()
