"""Triton paged attention vs the torch reference backend on fresh random batches.

Interpreter tests (CPU, fp32, tiny shapes) check the kernels' indexing: page gathers with
non-contiguous page ids, split ranges, causal tiles, GQA grouping, padding slots. GPU tests
check the compiled kernels at real head shapes in bf16/fp16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kernel_env import interpreted
from paged_cases import PagedBatch, make_paged_batch, run_both

from pdserve.ops.reference import TorchAttentionBackend, paged_attention, store_kv

# fp32 in the interpreter: only summation order differs from the reference.
INTERP_TOL = dict(atol=1e-4, rtol=1e-4)
# bf16/fp16 on GPU: P is rounded to the input dtype before the PV product (as in every
# flash kernel) and the output is rounded once; the reference keeps P in fp32.
GPU_TOL = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}
# Mean error bounds catch a systematic error hiding under the per-element tolerance.
GPU_MEAN_TOL = {torch.bfloat16: 4e-3, torch.float16: 6e-4}


def _backend(**options):
    from pdserve.ops.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend(**options)


def _check(batch: PagedBatch, backend, tol: dict, mean_tol: float | None = None) -> None:
    scale = batch.q.shape[-1] ** -0.5
    out, ref, caches = run_both(batch, backend, TorchAttentionBackend(), scale)
    rows = batch.num_real_tokens
    torch.testing.assert_close(out[:rows].float(), ref[:rows].float(), **tol)
    if mean_tol is not None:
        assert (out[:rows].float() - ref[:rows].float()).abs().mean().item() < mean_tol
    # Same cache contents afterwards: new K/V stored at their slots, padding slots skipped.
    torch.testing.assert_close(caches[0][0], caches[1][0], atol=0, rtol=0)
    torch.testing.assert_close(caches[0][1], caches[1][1], atol=0, rtol=0)


# --------------------------------------------------------------------------- interpreter

# Small splits so short contexts already use several of them (and leave some empty).
INTERP_OPTIONS = dict(max_kv_splits=4, min_split_tokens=16)


@interpreted
@pytest.mark.parametrize(
    "decode_lens, page_size, q_heads, kv_heads, head_dim, pad",
    [
        ([1, 15, 16, 17, 100], 16, 4, 1, 16, 2),  # page-boundary lengths, > splits, padding
        ([33, 70], 5, 2, 2, 32, 0),  # odd page size, plain multi-head
        ([50], 16, 24, 1, 16, 0),  # group of 24 > one 16-row head block
    ],
)
def test_decode_interpreted(decode_lens, page_size, q_heads, kv_heads, head_dim, pad):
    batch = make_paged_batch(
        decode_lens, [], q_heads, kv_heads, head_dim, page_size, pad_decode=pad, seed=pad
    )
    _check(batch, _backend(**INTERP_OPTIONS), INTERP_TOL)


@interpreted
def test_decode_one_split_interpreted():
    """One split: the split kernel writes the output itself and no reduce runs."""
    batch = make_paged_batch([1, 15, 40, 100], [], 4, 2, 16, 16, pad_decode=2, seed=11)
    _check(batch, _backend(max_kv_splits=1), INTERP_TOL)


# Context lengths around page (16) and tile boundaries, and long enough for every split.
RAGGED_LENS = [1, 15, 16, 17, 1000, 4097]
# The same for the interpreter, whose time grows with the tiles read: 1009 (63 full tiles
# and one token) still fills 32 splits of 16 tokens, 16 of 64 and 8 of 16, and 250 fills 8.
INTERP_RAGGED_LENS = [1, 15, 16, 17, 250, 1009]


def _ragged_batch(batch_size: int, q_heads: int = 4, kv_heads: int = 1, seed: int = 0,
                  **gpu: object) -> PagedBatch:
    """``batch_size`` decode sequences cycling through ``INTERP_RAGGED_LENS`` (on a GPU
    ``RAGGED_LENS``), their new K/V already stored (as the model's fused rotary + store
    kernel leaves them). ``gpu``: head_dim, dtype and device for a GPU batch (default: fp32
    on the CPU, head_dim 16)."""
    cycle = RAGGED_LENS if gpu.get("device") == "cuda" else INTERP_RAGGED_LENS
    lens = [cycle[(seed + i) % len(cycle)] for i in range(batch_size)]
    shape = {"head_dim": 16, **gpu}
    batch = make_paged_batch(lens, [], q_heads, kv_heads, page_size=16, seed=seed, **shape)
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    return batch


def _decode(batch: PagedBatch, num_splits: int, min_split_tokens: int, one_launch: bool,
            **splitting: int) -> torch.Tensor:
    """``decode_attention`` on the batch (the device's default tiles), into an output
    pre-filled with NaN so any row the kernel leaves unwritten fails the comparison.
    ``splitting``: its split_cap and balance_programs."""
    return _decode_counting(batch, num_splits, min_split_tokens, one_launch, **splitting)[0]


def _decode_counting(batch: PagedBatch, num_splits: int, min_split_tokens: int,
                     one_launch: bool, **splitting: int) -> tuple[torch.Tensor, list[int]]:
    """``_decode``'s output and the splits each context used."""
    from pdserve.ops.triton_attention import decode_attention, default_decode_config

    tiles = default_decode_config(batch.q.shape[-1], batch.q.device)
    config = dataclasses.replace(tiles, one_launch=one_launch)
    out = torch.full_like(batch.q, float("nan"))
    meta, scale = batch.meta, batch.q.shape[-1] ** -0.5
    used = decode_attention(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                            meta.seq_lens, out, scale, num_splits, min_split_tokens, config,
                            **splitting)  # fmt: skip
    return out, [1] * len(meta.seq_lens) if used is None else used.tolist()


def _reference_decode(batch: PagedBatch) -> torch.Tensor:
    return paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta,
                           batch.q.shape[-1] ** -0.5)  # fmt: skip


def _arrivals_all_zero() -> bool:
    from pdserve.ops import triton_attention

    return all(not counters.any() for counters in triton_attention._arrivals.values())


@interpreted
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize(
    "batch_size, num_splits, min_split_tokens",
    [(1, 32, 16), (1, 4, 64), (2, 8, 16), (3, 2, 16), (5, 16, 64), (8, 4, 128), (9, 1, 16)],
)
def test_decode_splits_on_ragged_contexts(batch_size, num_splits, min_split_tokens, one_launch):
    """Every split count merges to the reference: one used split written directly, several
    merged by the last to arrive (one launch) or by the reduce kernel (two launches)."""
    batch = _ragged_batch(batch_size, seed=batch_size)
    out = _decode(batch, num_splits, min_split_tokens, one_launch)
    torch.testing.assert_close(out, _reference_decode(batch), **INTERP_TOL)
    assert _arrivals_all_zero()


@interpreted
@pytest.mark.parametrize("one_launch", [True, False])
def test_long_context_beside_short_ones_takes_more_splits(one_launch):
    """With one split per context from the batch size (``split_cap`` 1), a context far
    longer than the others takes splits by its share of the batch's tokens (up to the
    grid's 8), the short ones keep one, and every output row matches the reference."""
    lens = [250, 17, 16, 15, 1, 1009]  # 1308 tokens; 2 programs per split here
    batch = make_paged_batch(lens, [], 4, 2, page_size=16, seed=7, head_dim=16)
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out, used = _decode_counting(batch, 8, 16, one_launch, split_cap=1, balance_programs=12)
    # 1308 x 2 / 12 -> 218 tokens a split: 2 for 250 tokens, 5 for 1009 (over 16-token tiles)
    assert used == [2, 1, 1, 1, 1, 5]
    torch.testing.assert_close(out, _reference_decode(batch), **INTERP_TOL)
    _, unbalanced = _decode_counting(batch, 8, 16, one_launch, split_cap=1)
    assert unbalanced == [1] * len(lens)


@interpreted
def test_balanced_split_counts_never_fall_below_the_cap():
    """Balancing only adds splits: contexts alike keep the count their batch size gives
    (one per 16 tokens up to the cap of 4) where their share of 2 programs is 1 split,
    and take more where their share of 64 programs is more (16 tokens, the floor)."""
    batch = make_paged_batch([200, 200, 200], [], 4, 1, page_size=16, seed=2, head_dim=16)
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out, used = _decode_counting(batch, 8, 16, False, split_cap=4, balance_programs=2)
    assert used == [4, 4, 4]
    torch.testing.assert_close(out, _reference_decode(batch), **INTERP_TOL)
    out, used = _decode_counting(batch, 8, 16, False, split_cap=4, balance_programs=64)
    assert used == [7, 7, 7]  # 13 tiles over 8 splits: 2 tiles a split, 7 splits used
    torch.testing.assert_close(out, _reference_decode(batch), **INTERP_TOL)


@interpreted
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=9),  # 128 take all 8 splits
       split_cap=st.sampled_from([1, 2, 4]), balance_programs=st.integers(2, 40),
       one_launch=st.booleans())
@example(lens=[150], split_cap=1, balance_programs=9, one_launch=False)  # 4 extra, pool of 4
@example(lens=[100, 200, 100], split_cap=1, balance_programs=25,
         one_launch=True)  # 3 + 6 + 3 extra, pool of 12
def test_balanced_pool_runs_every_split(lens, split_cap, balance_programs, one_launch):
    """A balanced launch has ``split_cap`` slots a context and a pool of
    ``balance_programs // 2`` for the splits past them (2 kv heads here, one head block
    each), not a program per context and split: whatever the lengths, the extra splits fit
    in the pool and every row matches the reference (an unrun split would leave its partial
    unwritten)."""
    batch = make_paged_batch(lens, [], 4, 2, page_size=16, seed=len(lens), head_dim=16)
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out, used = _decode_counting(batch, 8, 16, one_launch, split_cap=split_cap,
                                 balance_programs=balance_programs)  # fmt: skip
    assert sum(max(0, count - split_cap) for count in used) <= balance_programs // 2
    torch.testing.assert_close(out, _reference_decode(batch), **INTERP_TOL)


@interpreted
@pytest.mark.parametrize(
    "q_heads, kv_heads, head_dim, num_splits",
    [
        (16, 1, 64, 32),  # the merge takes the 32 splits 8 at a time (4 chunks)
        (12, 2, 16, 8),  # a group of 6: the merge's 8 rows include 2 masked ones
        (24, 1, 16, 4),  # a group of 24: two head blocks, the second half full
    ],
)
def test_one_launch_merge_shapes(q_heads, kv_heads, head_dim, num_splits):
    batch = _ragged_batch(3, q_heads, kv_heads, seed=4, head_dim=head_dim)  # 250, 1009, 1
    out = _decode(batch, num_splits, 16, one_launch=True)
    torch.testing.assert_close(out, _reference_decode(batch), **INTERP_TOL)


@interpreted
def test_one_launch_decode_twice_on_the_same_buffers():
    """The last split of each group sets its arrival count back to 0, so a second launch on
    the same counters (as a CUDA-graph replay is) merges again, on other contexts too."""
    first = _ragged_batch(4, q_heads=8, kv_heads=2, seed=0)  # contexts up to 17: 2 splits
    second = _ragged_batch(4, q_heads=8, kv_heads=2, seed=3)  # up to 1009: all 8 splits
    for batch in (first, first, second):
        out = _decode(batch, 8, 16, one_launch=True)
        torch.testing.assert_close(out, _reference_decode(batch), **INTERP_TOL)
        assert _arrivals_all_zero()


@interpreted
@pytest.mark.parametrize(
    "extend, page_size, q_heads, kv_heads",
    [
        ([(0, 37), (0, 16)], 16, 4, 2),  # pure prefill, ragged last tile
        ([(20, 5), (33, 40), (16, 1)], 16, 3, 1),  # cached prefix + new tokens
        ([(9, 20)], 7, 2, 2),  # odd page size, prefix ends mid-page
    ],
)
def test_extend_interpreted(extend, page_size, q_heads, kv_heads):
    batch = make_paged_batch([], extend, q_heads, kv_heads, 16, page_size, seed=len(extend))
    _check(batch, _backend(**INTERP_OPTIONS), INTERP_TOL)


@interpreted
def test_mixed_batch_interpreted():
    batch = make_paged_batch([5, 40], [(10, 20), (0, 33)], 2, 1, 16, seed=3)
    _check(batch, _backend(**INTERP_OPTIONS), INTERP_TOL)


@interpreted
def test_split_count_depends_on_batch_only():
    backend = _backend(max_kv_splits=32, num_sms=132, balance_splits=8)
    cpu = torch.device("cpu")
    assert [backend.even_kv_splits(n, 8, cpu) for n in (1, 16, 64, 128, 256, 600)] == [
        32, 4, 1, 1, 1, 1]
    # Balancing adds splits within 32 programs per SM: fewer as the batch grows.
    assert [backend.num_kv_splits(n, 8, cpu) for n in (1, 16, 64, 128, 256, 600)] == [
        32, 8, 8, 4, 2, 1]
    unbalanced = _backend(max_kv_splits=32, num_sms=132, balance_splits=1)
    assert [unbalanced.num_kv_splits(n, 8, cpu) for n in (1, 16, 256)] == [32, 4, 1]


@interpreted
def test_backend_balances_a_long_context_beside_short_ones():
    """The backend's own path (cap from the batch size, balance over two programs per SM)
    on a mixed batch of a long context and short ones matches the reference either way."""
    batch = make_paged_batch([1009, 17, 16, 15, 1, 100], [], 4, 2, 16, seed=5)
    for balance in (1, 4):
        _check(batch, _backend(max_kv_splits=4, min_split_tokens=16, num_sms=2,
                               balance_splits=balance), INTERP_TOL)  # fmt: skip


# --------------------------------------------------------------------------- GPU

HEAD_SHAPES = [(64, 8, 128), (32, 8, 128), (16, 16, 64), (8, 2, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_gpu(dtype, q_heads, kv_heads, head_dim, page_size):
    lens = [1, 15, 16, 17, 255, 1000, 4097, 9000]
    batch = make_paged_batch(
        lens, [], q_heads, kv_heads, head_dim, page_size, dtype, "cuda", pad_decode=2, seed=head_dim
    )
    _check(batch, _backend(), GPU_TOL[dtype], GPU_MEAN_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("balance", [1, 8])
def test_decode_gpu_long_context_beside_short_ones(balance):
    """48 decodes (one split each from the batch size on the H200): one of 9,000 tokens
    beside 300s takes more splits when balanced, and every row matches the reference."""
    batch = make_paged_batch([9000] + [300] * 47, [], 64, 8, 128, 16, torch.bfloat16, "cuda",
                             seed=1)  # fmt: skip
    backend = _backend(balance_splits=balance)
    _check(batch, backend, GPU_TOL[torch.bfloat16], GPU_MEAN_TOL[torch.bfloat16])
    from pdserve.ops.triton_attention import decode_attention

    meta, out = batch.meta, torch.empty_like(batch.q)
    used = decode_attention(batch.q, batch.k_cache, batch.v_cache, meta.block_tables,
                            meta.seq_lens, out, 128**-0.5,
                            **backend.decode_splitting(48, 8, batch.q.device))  # fmt: skip
    longest = 1 if used is None else used[0].item()
    assert (longest > 1) == (balance > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", HEAD_SHAPES)
def test_extend_gpu(dtype, q_heads, kv_heads, head_dim):
    extend = [(0, 1000), (300, 129), (4000, 1), (17, 64), (2048, 700)]
    batch = make_paged_batch(
        [], extend, q_heads, kv_heads, head_dim, 16, dtype, "cuda", seed=q_heads
    )
    _check(batch, _backend(), GPU_TOL[dtype], GPU_MEAN_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_gpu(dtype):
    batch = make_paged_batch(
        [3, 500, 2049], [(100, 300), (0, 513)], 64, 8, 128, 16, dtype, "cuda", seed=7
    )
    _check(batch, _backend(), GPU_TOL[dtype], GPU_MEAN_TOL[dtype])


@pytest.mark.gpu
def test_long_prefill_gpu():
    batch = make_paged_batch([], [(0, 4096)], 64, 8, 128, 16, torch.bfloat16, "cuda", seed=11)
    _check(batch, _backend(), GPU_TOL[torch.bfloat16], GPU_MEAN_TOL[torch.bfloat16])


@pytest.mark.gpu
def test_decode_cuda_graph_replay():
    """Captured once, replayed on batches with other context lengths and page tables."""
    shape = dict(q_heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    layout = dict(table_width=260, num_pages=8 * 260 + 1, device="cuda", pad_decode=1)
    batches = [
        make_paged_batch([7, 100, 1500, 33, 4000, 16, 2, 900], [], seed=1, **shape, **layout),
        make_paged_batch([4100, 1, 17, 64, 3000, 250, 8, 1], [], seed=2, **shape, **layout),
    ]
    static = make_paged_batch([1] * 8, [], seed=0, **shape, **layout)
    backend = _backend()
    scale = shape["head_dim"] ** -0.5
    graph, out = _capture_decode(backend, static, scale)
    for batch in batches:
        _load_into(static, batch)
        graph.replay()
        ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
        ref = TorchAttentionBackend().forward(
            batch.q, batch.k, batch.v, ref_k, ref_v, batch.meta, scale
        )
        torch.testing.assert_close(out.float(), ref.float(), **GPU_TOL[torch.bfloat16])
        torch.testing.assert_close(static.k_cache, ref_k, atol=0, rtol=0)


def _capture_decode(backend, static: PagedBatch, scale: float):
    args = (static.q, static.k, static.v, static.k_cache, static.v_cache, static.meta, scale)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        backend.forward(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args)
    return graph, out


def _load_into(static: PagedBatch, batch: PagedBatch) -> None:
    for name in ("q", "k", "v", "k_cache", "v_cache"):
        getattr(static, name).copy_(getattr(batch, name))
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        getattr(static.meta, name).copy_(getattr(batch.meta, name))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_one_split_gpu(dtype):
    """Large decode batches get one split: the split kernel writes the output directly."""
    lens = [1, 15, 16, 17, 255, 1000, 4097, 9000]
    batch = make_paged_batch(lens, [], 32, 8, 128, 16, dtype, "cuda", pad_decode=2, seed=1)
    _check(batch, _backend(max_kv_splits=1), GPU_TOL[dtype], GPU_MEAN_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("batch_size, num_splits", [(1, 32), (2, 16), (5, 8), (9, 4), (3, 1)])
def test_decode_paths_gpu(batch_size, num_splits, one_launch):
    """Both merge paths at CodeLlama-34B's head shape, ragged contexts, several splits."""
    batch = _ragged_batch(batch_size, 64, 8, seed=batch_size, head_dim=128,
                          dtype=torch.bfloat16, device="cuda")  # fmt: skip
    out = _decode(batch, num_splits, 64, one_launch)
    ref = _reference_decode(batch)
    torch.testing.assert_close(out.float(), ref.float(), **GPU_TOL[torch.bfloat16])


@pytest.mark.gpu
def test_one_launch_decode_repeated_gpu():
    """Many launches back to back on the same counters: a merge that read a partial before
    it was visible, or a count not set back to 0, shows up as a wrong or NaN row."""
    batch = _ragged_batch(9, 64, 8, seed=1, head_dim=128, dtype=torch.bfloat16, device="cuda")
    ref = _reference_decode(batch).float()
    outs = [_decode(batch, 32, 16, one_launch=True) for _ in range(200)]
    for out in outs:
        torch.testing.assert_close(out.float(), ref, **GPU_TOL[torch.bfloat16])
    assert _arrivals_all_zero()


def test_arrival_counters_one_row_per_stream(monkeypatch):
    """Streams get rows of their own (launches on two streams may overlap), a spare row is
    kept for a capture on a new stream, and a grown buffer keeps the old one alive (graphs
    captured before still point at it)."""
    pytest.importorskip("triton")
    from pdserve.ops import triton_attention as ta

    current = {"stream": 0}
    monkeypatch.setattr(ta, "_stream_id", lambda device: current["stream"])
    for name, empty in (("_arrivals", {}), ("_row_of_stream", {}), ("_retired_arrivals", [])):
        monkeypatch.setattr(ta, name, empty)
    cpu = torch.device("cpu")
    rows = {}
    for stream in range(20):
        current["stream"] = 7000 + stream
        rows[stream] = ta._arrival_counters(100, cpu)
    assert ta._arrivals[cpu].shape[0] > 20  # the spare row
    current["stream"] = 7003
    wide = ta._arrival_counters(10_000, cpu)
    assert wide.numel() >= 10_000 and not wide.any()
    now = [ta._arrival_counters(100, cpu).data_ptr()]
    for stream in range(20):
        current["stream"] = 7000 + stream
        now.append(ta._arrival_counters(100, cpu).data_ptr())
    assert len(set(now[1:])) == 20 and now[0] == now[4]
    assert any(r.data_ptr() == rows[0].data_ptr() for r in ta._retired_arrivals)


def _rope_inputs(batch: PagedBatch, rotary_dim: int, seed: int):
    """q, k, v as views of one fused [T, q + 2 kv] projection (as the model has them), the
    new tokens' positions and a cos/sin cache of ``rotary_dim`` channels."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = batch.q, batch.k, batch.v
    qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
    q_view, k_view, v_view = (t.view(q.shape[0], -1, q.shape[2]) for t in
                              qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1))
    positions = (batch.meta.seq_lens.long() - 1).clamp(min=0)
    cos_sin = torch.randn(int(positions.max()) + 1, rotary_dim, generator=gen)
    return q_view, k_view, v_view, positions.to(q.device), cos_sin.to(q.device)


def _check_fused_rope(batch: PagedBatch, rotary_dim: int, num_splits: int, one_launch: bool,
                      tol: dict) -> None:
    """The decode kernel with the rotary + K/V store fused in, against ``rope_store_kv``
    then attention (the reference path): same output rows, same cache afterwards."""
    from pdserve.ops import reference
    from pdserve.ops.triton_attention import NewTokenRope, decode_attention, default_decode_config

    q, k, v, positions, cos_sin = _rope_inputs(batch, rotary_dim, seed=num_splits)
    meta, scale = batch.meta, q.shape[-1] ** -0.5
    caches = [batch.k_cache.clone(), batch.v_cache.clone()]
    q_ref, k_ref = q.clone(), k.clone()
    reference.rope_store_kv(q_ref, k_ref, v, positions, cos_sin, *caches, meta.slot_mapping)
    want = reference.paged_attention(q_ref, *caches, meta, scale)
    config = dataclasses.replace(default_decode_config(q.shape[-1], q.device),
                                 one_launch=one_launch)
    out = torch.full_like(q, float("nan"))
    q_before = q.clone()
    decode_attention(q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, out,
                     scale, num_splits, 16, config,
                     NewTokenRope(k, v, positions, cos_sin, meta.slot_mapping))  # fmt: skip
    rows = batch.num_real_tokens
    torch.testing.assert_close(out[:rows].float(), want[:rows].float(), **tol)
    torch.testing.assert_close(q, q_before, atol=0, rtol=0)  # q is read, never written
    torch.testing.assert_close(batch.k_cache, caches[0], **tol)
    torch.testing.assert_close(batch.v_cache, caches[1], atol=0, rtol=0)


@interpreted
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize(
    "decode_lens, q_heads, kv_heads, rotary_dim, num_splits, pad",
    [
        ([1, 15, 16, 17, 100], 4, 1, 16, 4, 2),  # page edges, several splits, padding rows
        ([33, 70], 2, 2, 8, 8, 0),  # partial rotary: channels past 8 pass unrotated
        ([50], 24, 1, 16, 2, 0),  # a group of 24: two head blocks store the same K/V
        ([3, 90], 4, 2, 16, 1, 1),  # one split: written directly
    ],
)
def test_decode_with_fused_rope_interpreted(decode_lens, q_heads, kv_heads, rotary_dim,
                                            num_splits, pad, one_launch):
    batch = make_paged_batch(decode_lens, [], q_heads, kv_heads, 16, 16, pad_decode=pad,
                             seed=len(decode_lens) + pad)  # fmt: skip
    _check_fused_rope(batch, rotary_dim, num_splits, one_launch, INTERP_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("num_splits, rotary_dim", [(32, 128), (8, 64), (1, 128)])
def test_decode_with_fused_rope_gpu(num_splits, rotary_dim, one_launch):
    """Llama-3-8B's heads. The interpreter runs programs one after another, so only here can
    a split read the new token's slot before the split that stores it has written it."""
    lens = [1, 15, 16, 17, 255, 1000, 4097]
    batch = make_paged_batch(lens, [], 32, 8, 128, 16, torch.bfloat16, "cuda", pad_decode=2,
                             seed=num_splits)  # fmt: skip
    _check_fused_rope(batch, rotary_dim, num_splits, one_launch, GPU_TOL[torch.bfloat16])
