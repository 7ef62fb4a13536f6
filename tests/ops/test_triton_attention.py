"""Triton paged attention vs the torch reference backend on fresh random batches.

Interpreter tests (CPU, fp32, tiny shapes) check the kernels' indexing: page gathers with
non-contiguous page ids, split ranges, causal tiles, GQA grouping, padding slots. GPU tests
check the compiled kernels at real head shapes in bf16/fp16.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import interpreted
from paged_cases import PagedBatch, make_paged_batch, run_both

from pdserve.ops.reference import TorchAttentionBackend

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
    backend = _backend(max_kv_splits=32, num_sms=132)
    cpu = torch.device("cpu")
    assert backend.num_kv_splits(1, 8, cpu) == 32
    assert backend.num_kv_splits(16, 8, cpu) == 4
    assert backend.num_kv_splits(256, 8, cpu) == 1


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
