"""Block-free KV transfer: gather from one pool, scatter into another, token by token."""

from __future__ import annotations

import pytest
import torch

from pdserve.cache.kv_pool import allocate_kv_pool
from pdserve.config import ModelConfig
from pdserve.model.arch import get_arch
from pdserve.transfer import (
    KVLayout,
    LocalTransport,
    flat_pool_view,
    gather_blocks,
    scatter_blocks,
)

HEADS, DIM = 2, 4


def _pool(num_layers: int, num_blocks: int, block_size: int, device="cpu"):
    pool = torch.randn(num_layers, 2, num_blocks, block_size, HEADS, DIM, device=device)
    return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]


def _split_pool(num_layers: int, num_blocks: int, block_size: int, cut: int):
    """Two page ranges of one tensor, as the disaggregated engine carves its pools."""
    whole = _pool(num_layers, num_blocks, block_size)
    return [(k[:cut], v[:cut]) for k, v in whole], [(k[cut:], v[cut:]) for k, v in whole]


def _token_kv(kv_caches, block_ids, block_size, num_tokens):
    """Reference: [layers, 2, tokens, heads, dim] by a plain Python walk over tokens."""
    rows = []
    for k, v in kv_caches:
        pair = []
        for pages in (k, v):
            pair.append(torch.stack([pages[block_ids[t // block_size], t % block_size]
                                     for t in range(num_tokens)]))
        rows.append(torch.stack(pair))
    return torch.stack(rows)


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 29, 32])
@pytest.mark.parametrize("num_layers", [1, 3, 12])
def test_round_trip_into_another_pool(num_layers, num_tokens):
    block_size = 8
    src = _pool(num_layers, 16, block_size)
    dst = _pool(num_layers, 10, block_size)
    needed = -(-num_tokens // block_size)
    src_ids = [13, 2, 7, 11][:needed]
    dst_ids = [4, 9, 0, 6][:needed]
    before = [(k.clone(), v.clone()) for k, v in dst]
    buffer = gather_blocks(src, src_ids, num_tokens)
    assert buffer.is_contiguous()
    assert buffer.shape == (num_layers, 2, num_tokens, HEADS, DIM)
    scatter_blocks(buffer, dst, dst_ids)
    want = _token_kv(src, src_ids, block_size, num_tokens)
    assert torch.equal(_token_kv(dst, dst_ids, block_size, num_tokens), want)
    # Only the request's tokens changed: the rest of a partial last page and other pages not.
    for (k, v), (k0, v0) in zip(dst, before, strict=True):
        for pages, old in ((k, k0), (v, v0)):
            flat, flat_old = pages.flatten(0, 1), old.flatten(0, 1)
            slots = {b * block_size + i for b in dst_ids for i in range(block_size)}
            written = sorted(dst_ids[t // block_size] * block_size + t % block_size
                             for t in range(num_tokens))
            untouched = sorted(set(range(flat.shape[0])) - set(written))
            assert torch.equal(flat[untouched], flat_old[untouched])
            assert set(written) <= slots


def test_split_pools_use_the_one_kernel_path():
    prefill, decode = _split_pool(4, 20, 4, cut=6)
    assert flat_pool_view(prefill) is not None and flat_pool_view(decode) is not None
    buffer = gather_blocks(prefill, [5, 0, 3], 10)
    scatter_blocks(buffer, decode, [13, 1, 7])
    assert torch.equal(_token_kv(decode, [13, 1, 7], 4, 10), _token_kv(prefill, [5, 0, 3], 4, 10))


def test_engine_pool_is_one_strided_view():
    arch = get_arch(ModelConfig())
    kv = allocate_kv_pool(arch, 5, 4, torch.float32, torch.device("cpu"))
    view = flat_pool_view(kv)
    assert view is not None and view.shape[:3] == (arch.num_layers, 2, 20)
    assert view.data_ptr() == kv[0][0].data_ptr()


def test_unrelated_tensors_fall_back_per_layer():
    src = [(torch.randn(6, 4, HEADS, DIM), torch.randn(6, 4, HEADS, DIM)) for _ in range(3)]
    dst = [(torch.zeros(3, 4, HEADS, DIM), torch.zeros(3, 4, HEADS, DIM)) for _ in range(3)]
    assert flat_pool_view(src) is None
    scatter_blocks(gather_blocks(src, [4, 1], 6), dst, [2, 0])
    assert torch.equal(_token_kv(dst, [2, 0], 4, 6), _token_kv(src, [4, 1], 4, 6))


def test_preallocated_out_buffer():
    src = _pool(2, 4, 4)
    out = torch.empty(2, 2, 5, HEADS, DIM)
    assert gather_blocks(src, [3, 1], 5, out=out) is out
    with pytest.raises(ValueError):
        gather_blocks(src, [3, 1], 6, out=out)
    with pytest.raises(ValueError):
        gather_blocks(src, [3], 5)


def test_local_transport_counts_bytes():
    src, dst = _split_pool(3, 12, 4, cut=5)
    transport = LocalTransport()
    buffer = gather_blocks(src, [1, 4], 6)
    transport.send("r1", buffer)
    assert transport.pending() == 1
    scatter_blocks(transport.recv("r1"), dst, [0, 6])
    assert transport.stats.num_transfers == 1
    assert transport.stats.num_bytes == KVLayout.of(buffer).num_bytes == 3 * 2 * 6 * HEADS * DIM * 4
    with pytest.raises(KeyError):
        transport.recv("r1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_transfer_across_streams():
    src = _pool(4, 32, 16, device="cuda")
    dst = _pool(4, 32, 16, device="cuda")
    sender, receiver = torch.cuda.Stream(), torch.cuda.Stream()
    transport = LocalTransport()
    with torch.cuda.stream(sender):
        transport.send("r", gather_blocks(src, [30, 2, 17], 40), stream=sender)
    with torch.cuda.stream(receiver):
        scatter_blocks(transport.recv("r", stream=receiver), dst, [1, 5, 9])
    torch.cuda.synchronize()
    assert torch.equal(_token_kv(dst, [1, 5, 9], 16, 40), _token_kv(src, [30, 2, 17], 16, 40))
