"""The extend kernel's layouts: GQA packing (rows = token x q head of one kv head) and the
cached prefix split across programs then merged, against the torch reference.

Interpreter tests (CPU, fp32, tiny shapes) check the indexing: packed rows and their causal
mask, tiles that start inside a key tile, ragged and empty splits, decode rows left alone in
a mixed batch. GPU tests run CodeLlama-34B's head shape (64 q heads, 8 kv heads, 128 dims).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_env import interpreted
from paged_cases import PagedBatch, make_paged_batch

from pdserve.ops.reference import paged_attention, store_kv

INTERP_TOL = dict(atol=1e-4, rtol=1e-4)
GPU_TOL = dict(atol=3e-2, rtol=3e-2)  # bf16, as in test_triton_attention.py
GPU_MEAN_TOL = 4e-3


def _config(pack_gqa: bool, kv_splits: int, block_m: int = 16, block_n: int = 16, **gpu):
    from pdserve.ops.triton_attention import ExtendConfig

    tiles = dict(num_warps=1, num_stages=1) if not gpu else gpu
    return ExtendConfig(block_m, block_n, pack_gqa=pack_gqa, kv_splits=kv_splits, **tiles)


def _batch(decode_lens, extend, q_heads, kv_heads, head_dim, page_size=16, seed=0,
           **gpu) -> PagedBatch:
    """A batch whose new K/V are already in the cache (as the model's store leaves them)."""
    batch = make_paged_batch(decode_lens, extend, q_heads, kv_heads, head_dim, page_size,
                             seed=seed, **gpu)  # fmt: skip
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    return batch


def _extend_vs_reference(batch: PagedBatch, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) rows of the extend sequences; the kernel writes into NaN, and the
    decode rows before them must stay NaN (the kernel and the merge leave them alone)."""
    from pdserve.ops.triton_attention import extend_attention

    meta, scale = batch.meta, batch.q.shape[-1] ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    extend_attention(batch.q, batch.k, batch.v, out, batch.k_cache, batch.v_cache, meta, scale,
                     first_seq=meta.num_decode_seqs, config=config)  # fmt: skip
    first_row = meta.num_decode_seqs  # decode sequences have one row each
    assert out[:first_row].isnan().all()
    ref = paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, scale)
    return out[first_row:].float(), ref[first_row:].float()


# --------------------------------------------------------------------------- interpreter


@interpreted
@pytest.mark.parametrize(
    "decode_lens, extend, q_heads, kv_heads, head_dim, page_size, block_n, kv_splits",
    [
        # MHA (group 1): packing is the plain layout; prefixes off and on tile boundaries;
        # 16-row tiles inside 32-token key tiles (no longer refused unpacked either).
        ([], [(20, 5), (32, 40), (0, 17)], 2, 2, 16, 16, 32, 1),
        # group 4, 4 tokens a tile inside 32-token key tiles; two splits, one of them empty
        # for the 9-token prefix; odd page size.
        ([], [(0, 37), (9, 20), (70, 3)], 8, 2, 64, 7, 32, 2),
        # group 8: 2 tokens a tile; decodes first (first_seq 3); four splits.
        ([5, 40, 1], [(33, 12), (64, 1)], 8, 1, 16, 16, 16, 4),
        # head_dim 128, group 4, prefix ending mid-page, split in two.
        ([7], [(45, 6)], 4, 1, 128, 16, 16, 2),
    ],
)
def test_packed_gqa_matches_reference(decode_lens, extend, q_heads, kv_heads, head_dim,
                                      page_size, block_n, kv_splits):
    batch = _batch(decode_lens, extend, q_heads, kv_heads, head_dim, page_size, seed=q_heads)
    out, ref = _extend_vs_reference(batch, _config(True, kv_splits, block_n=block_n))
    torch.testing.assert_close(out, ref, **INTERP_TOL)


@interpreted
@pytest.mark.parametrize(
    "decode_lens, extend, q_heads, kv_heads, block_m, kv_splits",
    [
        ([], [(50, 4), (0, 33), (17, 16)], 4, 2, 16, 2),  # ragged prefixes and chunks
        ([3, 18], [(100, 5)], 2, 1, 32, 4),  # decodes first, 2 of 4 splits past the prefix
        ([], [(16, 20)], 2, 2, 16, 8),  # more splits than prefix tiles: most run empty
    ],
)
def test_split_prefix_matches_reference(decode_lens, extend, q_heads, kv_heads, block_m,
                                        kv_splits):
    batch = _batch(decode_lens, extend, q_heads, kv_heads, 16, seed=kv_splits)
    out, ref = _extend_vs_reference(batch, _config(False, kv_splits, block_m=block_m))
    torch.testing.assert_close(out, ref, **INTERP_TOL)


@interpreted
@pytest.mark.parametrize(
    "decode_lens, extend, block_m, kv_splits, row_start",
    [
        # the longest chunk 6 rows past one 64-row tile: a packed tail launch (32 tokens a
        # tile at group 2); shorter chunks end inside the whole tile or have none past it
        ([], [(30, 70), (10, 40), (0, 66)], 64, 1, 64),
        # decodes first, two prefix splits merged in each launch; 22 rows in the tail
        ([4, 9], [(100, 150), (7, 129)], 64, 2, 128),
        # a chunk shorter than half a tile: the tail launch alone
        ([], [(40, 5)], 64, 1, 0),
    ],
)
def test_rows_past_the_last_whole_tile_run_in_a_packed_tail_launch(decode_lens, extend,
                                                                   block_m, kv_splits,
                                                                   row_start):
    from pdserve.ops.triton_attention import extend_launches

    batch = _batch(decode_lens, extend, 4, 2, 16, seed=block_m + kv_splits)
    # On one SM every program is a wave of its own: where the packed tail pays
    batch = dataclasses.replace(batch, meta=dataclasses.replace(batch.meta, launch_sms=1))
    config = dataclasses.replace(_config(False, kv_splits, block_m=block_m), tail_tiles=True)
    launches = extend_launches(config, batch.meta, 4, 2, len(decode_lens), torch.device("cpu"))
    assert [(x.row_heads, x.row_start) for x in launches][-1] == (2, row_start)
    assert len(launches) == (1 if row_start == 0 else 2)
    out, ref = _extend_vs_reference(batch, config)
    torch.testing.assert_close(out, ref, **INTERP_TOL)


@interpreted
def test_the_tail_launch_splits_the_prefix_by_its_own_grid():
    """Auto splits on 8 SMs over a 2,048-token prefix, two chunks: the whole tiles' 8
    programs fill the SMs unsplit, the packed tail's 4 split in two and merge their own
    partials."""
    from pdserve.ops.triton_attention import extend_launches

    batch = _batch([3], [(2048, 70), (500, 30)], 4, 2, 16, seed=7)
    meta = dataclasses.replace(batch.meta, launch_sms=8)
    batch = dataclasses.replace(batch, meta=meta)
    config = dataclasses.replace(_config(False, 0, block_m=64), tail_tiles=True)
    launches = extend_launches(config, meta, 4, 2, 1, torch.device("cpu"))
    assert [(x.splits, x.row_heads, x.row_start) for x in launches] == [(1, 1, 0), (2, 2, 64)]
    assert [x.grid for x in launches] == [(1, 4, 2), (2, 2, 2)]
    out, ref = _extend_vs_reference(batch, config)
    torch.testing.assert_close(out, ref, **INTERP_TOL)


@pytest.mark.parametrize("chunk, prefix, launched", [
    (263, 10240, [(1, 1, 0), (8, 8, 256)]),  # measured 0.93x of one launch on the H100
    (135, 10240, [(1, 2, 0), (8, 8, 128)]),  # 0.94x
    (7, 10240, [(8, 8, 0)]),  # 0.88x
    (263, 2048, [(1, 1, 0), (8, 4, 256)]),  # 0.98x (beside 8 decodes)
    (263, 1024, [(1, 1, 0), (8, 2, 256)]),
    (263, 512, [(1, 1, 0)]),  # a short prefix: the last tile's wave is short, no tail
    (263, 0, [(1, 1, 0)]),
    (383, 10240, [(1, 2, 0)]),  # 127 rows: more than half a tile
])
def test_a_tail_launch_where_the_cost_model_gains(chunk, prefix, launched):
    """codellama-34b's heads on 132 SMs, auto splits: (q heads per tile row block, splits,
    first row) of each launch."""
    pytest.importorskip("triton")
    from pdserve.ops.triton_attention import ExtendConfig, LaunchShape, plan_extend_launches

    config = ExtendConfig(128, 128, 8, 3, kv_splits=0, tail_tiles=True)
    shape = LaunchShape(64, 1, prefix, torch.device("cpu"))
    launches = plan_extend_launches(config, chunk, 8, shape)
    assert [(x.row_heads, x.splits, x.row_start) for x in launches] == launched


def test_a_tail_launch_only_where_the_rows_fill_half_a_tile_or_less_and_pack():
    from pdserve.ops.triton_attention import ExtendConfig, _extend_tail

    config = ExtendConfig(128, 128, 8, 3, tail_tiles=True)
    assert _extend_tail(config, 257, 8) == 256
    assert _extend_tail(config, 320, 8) == 256
    assert _extend_tail(config, 321, 8) is None  # 65 rows: more than half a tile
    assert _extend_tail(config, 384, 8) is None  # whole tiles
    assert _extend_tail(config, 257, 1) is None  # no GQA group to pack
    assert _extend_tail(config, 257, 6) is None  # a group that does not divide the tile
    assert _extend_tail(dataclasses.replace(config, tail_tiles=False), 257, 8) is None
    assert _extend_tail(dataclasses.replace(config, pack_gqa=True), 257, 8) is None


@interpreted
@pytest.mark.parametrize("pack_gqa", [False, True])
def test_auto_splits_on_a_long_prefix(pack_gqa):
    """kv_splits=0 on a short chunk over a 1100-token prefix picks 2 splits (one per 512
    tokens of context); the merged result matches the reference."""
    from pdserve.ops.triton_attention import extend_kv_splits

    batch = _batch([9], [(1100, 3)], 4, 1, 16, seed=5)
    assert extend_kv_splits(0, 2, batch.meta.max_seq_len, batch.q.device) == 2
    out, ref = _extend_vs_reference(batch, _config(pack_gqa, 0))
    torch.testing.assert_close(out, ref, **INTERP_TOL)


def test_auto_split_count_follows_the_grid_and_the_context():
    pytest.importorskip("triton")
    from pdserve.ops.triton_attention import extend_kv_splits

    cpu = torch.device("cpu")  # counted as 132 SMs
    assert extend_kv_splits(0, 128, 15616, cpu) == 1  # 256 new over 15K: about a wave
    assert extend_kv_splits(0, 64, 16448, cpu) == 2  # 64 new over 16K: half a wave, x 2
    assert extend_kv_splits(0, 1024, 18432, cpu) == 1  # 2K new over 16K fills the GPU
    assert extend_kv_splits(0, 8, 1100, cpu) == 2  # capped by the context: 2 x 512 tokens
    assert extend_kv_splits(0, 1, 100_000, cpu) == 8  # capped at 8
    assert extend_kv_splits(4, 10_000, 10, cpu) == 4  # an explicit count is kept
    with pytest.raises(ValueError, match="power of two"):
        extend_kv_splits(3, 8, 1000, cpu)


def test_auto_split_count_fills_the_last_wave():
    """The count whose waves of shares (plus a split's fixed cost) take least: a 3-tile
    chunk of codellama-34b's 64 q heads (192 programs on 132 SMs) runs two waves at 1 split
    and three of half programs at 2; a 5-tile one splits only over a long prefix."""
    pytest.importorskip("triton")
    from pdserve.ops.triton_attention import extend_kv_splits

    cpu = torch.device("cpu")  # counted as 132 SMs
    assert extend_kv_splits(0, 192, 10_000, cpu) == 2  # 2 waves -> 1.5
    assert extend_kv_splits(0, 192, 4_096, cpu) == 2  # 0.90x by the cost model
    assert extend_kv_splits(0, 320, 10_000, cpu) == 2  # 5 tiles: 3 waves -> 2.5
    assert extend_kv_splits(0, 320, 4_096, cpu) == 2  # 0.99-1.04x on the H100 sweeps: a tie
    assert extend_kv_splits(0, 256, 10_000, cpu) == 1  # 1.94 waves: nothing to gain
    assert extend_kv_splits(0, 384, 10_000, cpu) == 1  # 2.9 waves
    assert extend_kv_splits(0, 512, 16_384, cpu) == 1  # a 1K chunk: 3.9 waves
    assert extend_kv_splits(0, 200, 10_000, cpu) == 1  # 2 waves; 4 of halves, 7 of quarters
    assert extend_kv_splits(0, 64, 4_096, cpu) == 2  # one wave of halves, not two of quarters
    assert extend_kv_splits(0, 192, 10_000, cpu, sms=108) == 1  # two waves on a partition
    assert extend_kv_splits(0, 64, 16_448, cpu, sms=108) == 8  # 2: two waves; 8: five, 0.88x
    assert extend_kv_splits(0, 64, 16_448, cpu, sms=132) == 2
    # The partition sweep's fastest counts: 3 tiles over 8K on 84 SMs (3 waves -> 5 halves)
    # and 1 tile over 4K there (every split slower).
    assert extend_kv_splits(0, 192, 8_192, cpu, sms=84) == 2
    assert extend_kv_splits(0, 64, 4_096, cpu, sms=84) == 1
    assert extend_kv_splits(0, 192, 1_000, cpu) == 1  # a split keeps 512 prefix tokens
    assert extend_kv_splits(0, 192, 0, cpu) == 1  # no prefix: nothing to split


def test_the_prefix_bound_comes_from_the_extend_sequences():
    """A long decode context beside a fresh prompt leaves the prompt nothing to split."""
    pytest.importorskip("triton")
    from pdserve.model.testing import build_metadata
    from pdserve.ops.triton_attention import extend_prefix_bound

    tables = [[1, 2, 3, 4], [5, 6, 7, 8]]
    meta = build_metadata([8191, 0], [1, 300], tables, block_size=2048)
    assert meta.max_extend_prefix_len == 0 and extend_prefix_bound(meta) == 0
    meta = build_metadata([8191, 5000], [1, 300], tables, block_size=2048)
    assert extend_prefix_bound(meta) == 5000
    unknown = dataclasses.replace(meta, max_extend_prefix_len=None)
    assert extend_prefix_bound(unknown) == 8192 - 300  # longest context less longest query


# setting: (variable, its cached reader, config field, GPU default, the interpreter's value,
# accepted values, a refused one)
ENV_SETTINGS = {
    "splits": ("EXTEND_SPLITS_ENV", "_extend_splits_from_env", "kv_splits", 0, 1,
               (("0", 0), ("1", 1), ("4", 4)), "3"),
    "tail": ("EXTEND_TAIL_ENV", "_extend_tail_from_env", "tail_tiles", True, False,
             (("0", False), ("1", True)), "yes"),
}


@pytest.mark.parametrize("setting", sorted(ENV_SETTINGS))
def test_gpu_extend_config_follows_the_environment(monkeypatch, setting):
    """On a GPU the prefix splits (default 0: the auto rule; a power of two fixes them, 1: no
    splits) and the tail launch (default on, 0: off) follow their variables, anything else
    refused; the interpreter's tiles keep one split and no tail launch whatever they say."""
    pytest.importorskip("triton")
    from pdserve.ops import triton_attention as ta

    env, reader, field, gpu_default, cpu_value, accepted, refused = ENV_SETTINGS[setting]
    env, read = getattr(ta, env), getattr(ta, reader)

    def value(device: str):
        return getattr(ta.default_extend_config(128, torch.device(device), hopper=True), field)

    try:
        monkeypatch.delenv(env, raising=False)
        read.cache_clear()
        assert value("cuda") == gpu_default and value("cpu") == cpu_value
        for raw, expected in accepted:
            monkeypatch.setenv(env, raw)
            read.cache_clear()
            assert value("cuda") == expected and value("cpu") == cpu_value
        monkeypatch.setenv(env, refused)
        read.cache_clear()
        with pytest.raises(ValueError, match=env):
            value("cuda")
    finally:
        read.cache_clear()


@interpreted
@pytest.mark.parametrize("q_heads, kv_heads", [(12, 2), (32, 1)])
def test_packing_refuses_a_group_that_does_not_divide_the_tile(q_heads, kv_heads):
    """A group of 6 does not divide a 16-row tile; a group of 32 is larger than it."""
    batch = _batch([], [(4, 4)], q_heads, kv_heads, 16)
    with pytest.raises(ValueError, match="pack_gqa needs the GQA group"):
        _extend_vs_reference(batch, _config(True, 1, block_m=16))


# --------------------------------------------------------------------------- GPU

# A prompt, a long chunk, and the short chunks over long prefixes that split pays off on.
GPU_EXTEND = [(0, 1000), (4000, 1), (2048, 700), (11000, 256), (333, 129)]


@pytest.mark.gpu
@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("kv_splits", [1, 2, 0])
def test_codellama_shape_gpu(pack_gqa, kv_splits):
    from pdserve.ops.triton_attention import default_extend_config

    tiles = default_extend_config(128, torch.device("cuda"))
    config = _config(pack_gqa, kv_splits, tiles.block_m, tiles.block_n,
                     num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip
    batch = _batch([3, 500, 2049], GPU_EXTEND, 64, 8, 128, seed=kv_splits,
                   dtype=torch.bfloat16, device="cuda")  # fmt: skip
    out, ref = _extend_vs_reference(batch, config)
    torch.testing.assert_close(out, ref, **GPU_TOL)
    assert (out - ref).abs().mean().item() < GPU_MEAN_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kv_splits", [4, 0])
def test_short_chunk_over_long_prefix_gpu(kv_splits):
    """The multiplexing chunk shape: 256 new tokens over a 15K prefix, packed and split."""
    from pdserve.ops.triton_attention import default_extend_config

    tiles = default_extend_config(128, torch.device("cuda"))
    config = _config(True, kv_splits, tiles.block_m, tiles.block_n,
                     num_warps=tiles.num_warps, num_stages=tiles.num_stages)  # fmt: skip
    batch = _batch([], [(15360, 256)], 64, 8, 128, seed=1, dtype=torch.bfloat16, device="cuda")
    out, ref = _extend_vs_reference(batch, config)
    torch.testing.assert_close(out, ref, **GPU_TOL)
    assert (out - ref).abs().mean().item() < GPU_MEAN_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kv_splits", [1, 2, 0])
@pytest.mark.parametrize("longest", [264, 320, 40])
def test_codellama_shape_tail_launch_gpu(kv_splits, longest):
    """The rows past the longest chunk's whole tiles in a packed tail launch (8, 64 rows; a
    chunk under half a tile in the tail launch alone), beside shorter chunks and decodes."""
    from pdserve.ops.triton_attention import default_extend_config, extend_launches

    tiles = default_extend_config(128, torch.device("cuda"))
    config = dataclasses.replace(
        _config(False, kv_splits, tiles.block_m, tiles.block_n, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages), tail_tiles=True)
    extend = [(10240, longest), (2048, min(longest, 100)), (0, 17)]
    batch = _batch([3, 500], extend, 64, 8, 128, seed=longest, dtype=torch.bfloat16,
                   device="cuda")
    launches = extend_launches(config, batch.meta, 64, 8, 2, torch.device("cuda"))
    assert launches[-1].row_heads == 8  # the packed tail launch runs
    out, ref = _extend_vs_reference(batch, config)
    torch.testing.assert_close(out, ref, **GPU_TOL)
    assert (out - ref).abs().mean().item() < GPU_MEAN_TOL
