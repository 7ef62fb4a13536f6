"""Kernel speed on one GPU, each beside its hardware ceiling measured in the same run.

- Ceilings: device-to-device copy bandwidth (read + write bytes) and 8192^3 bf16 GEMM rate.
- Decode attention (Triton split-KV, timed as a CUDA-graph replay so launch cost does not
  count): batch x context for CodeLlama-34B and Llama-3-8B head shapes, reported as KV
  bytes read per second against the copy ceiling.
- Prefill attention (Triton extend kernel, causal, one prompt; plus a chunk over a cached
  prefix): TFLOP/s against the GEMM ceiling, next to torch SDPA on contiguous K/V. The
  extend sweep also times its layouts (GQA packing on/off x prefix splits 1/2/4/auto).
- ``--extend-waves``: chunks of 64-1024 tokens over 4-16K-token prefixes at 1, 2 and 4
  prefix splits, beside the count the auto rule picks (grids in whole waves or not).
- Fused ops (Triton vs the torch reference): time and achieved bandwidth.
- ``--decode-ab``: decode attention per layer inside a CUDA graph of several layers (KV
  larger than L2), one launch (splits merged by the last to arrive) vs two (split + reduce
  kernel); two launches at 128 vs 64 tokens per split, and at one 128-token tile per split
  (8B and 34B heads, batch 1..8, 1K and 4K context); and a sweep of split sizes and tiles
  at batch 1..8 and 256 (1K context).
- ``--decode-balance``: decode attention per layer with long contexts balanced over more
  splits against split counts from the batch size alone, on contexts alike, spread, and
  one long beside short ones (batch 16..256).

    python benchmarks/bench_kernels.py --out benchmarks/results/kernels_h200.json
    python benchmarks/bench_kernels.py --quick              # a few points, for a smoke run
    python benchmarks/bench_kernels.py --sweep              # also try other tile configs
    python benchmarks/bench_kernels.py --extend-sweep-only  # prefill-attention tiles, layouts
    python benchmarks/bench_kernels.py --extend-waves       # prefix splits against waves
    python benchmarks/bench_kernels.py --extend-waves --extend-waves-sms 108,84  # on partitions
    python benchmarks/bench_kernels.py --decode-ab          # one-launch vs two-launch decode
    python benchmarks/bench_kernels.py --decode-balance     # long contexts over more splits
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from pdserve.bench.report import revision_fields
from pdserve.ops import reference, triton_fused
from pdserve.ops.metadata import AttentionMetadata
from pdserve.ops.triton_attention import (
    DecodeConfig,
    ExtendConfig,
    TritonAttentionBackend,
    decode_attention,
    default_decode_config,
    default_extend_config,
    extend_attention,
    extend_grid,
)

HEAD_SHAPES = {"34b": (64, 8, 128), "8b": (32, 8, 128)}  # q heads, kv heads, head_dim
DECODE_BATCHES = (1, 16, 64, 256)
CONTEXTS = (1024, 8192, 32768)
PAGE_SIZE = 16
DTYPE = torch.bfloat16


# --------------------------------------------------------------------------- ceilings


def measure_ceilings() -> dict:
    ceilings = {"copy_gbs": _copy_gbs(), "gemm_tflops": _gemm_tflops()}
    torch.cuda.empty_cache()
    return ceilings


def _copy_gbs() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * (1 << 30) / ms / 1e6  # bytes read + bytes written


def _gemm_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    ms = do_bench(lambda: a @ b, warmup=25, rep=200)
    return 2 * 8192**3 / ms / 1e9


# --------------------------------------------------------------------------- decode


def paged_cache(num_tokens_per_seq: list[int], kv_heads: int, head_dim: int):
    """A cache holding exactly the sequences' pages, handed out in a random order."""
    pages_per_seq = [triton.cdiv(n, PAGE_SIZE) for n in num_tokens_per_seq]
    num_pages = sum(pages_per_seq) + 1
    shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device="cuda").normal_()
    perm = torch.randperm(num_pages - 1, device="cuda", dtype=torch.int32) + 1
    tables = torch.zeros(len(pages_per_seq), max(pages_per_seq), dtype=torch.int32, device="cuda")
    offset = 0
    for i, n in enumerate(pages_per_seq):
        tables[i, :n] = perm[offset : offset + n]
        offset += n
    return k_cache, v_cache, tables


def bench_decode(
    shape: str, batch: int, context: int, backend: TritonAttentionBackend, config=None
) -> dict:
    q_heads, kv_heads, head_dim = HEAD_SHAPES[shape]
    k_cache, v_cache, tables = paged_cache([context] * batch, kv_heads, head_dim)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, q_heads, head_dim, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    splitting = backend.decode_splitting(batch, kv_heads, q.device)
    splits = splitting["num_splits"]
    run = lambda: decode_attention(
        q, k_cache, v_cache, tables, seq_lens, out, head_dim**-0.5, config=config, **splitting
    )  # fmt: skip
    run()  # compile outside the capture
    ms = do_bench_cudagraph(run, rep=100)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    # Replays back to back keep a small cache resident in the 50 MB L2; in a model the other
    # layers evict it, so such points overstate the bandwidth.
    return {"kernel": "decode", "shape": shape, "batch": batch, "context": context,
            "splits": splits, "ms": ms, "kv_gbs": kv_bytes / ms / 1e6,
            "kv_fits_l2": kv_bytes < 60e6}  # fmt: skip


# --------------------------------------------------------------------------- decode A/B

# Batch x context points where the one-launch decode is timed against the two-launch path.
DECODE_AB_POINTS = [(b, c) for b in (1, 8, 64, 256) for c in (1024, 16384)]
# At least this much KV per timed graph, so it cannot sit in the 50 MB L2 between replays.
_AB_MIN_GRAPH_BYTES = 256e6
_AB_MAX_LAYERS = 48  # CodeLlama-34B's layer count


def bench_decode_layers(shape: str, batch: int, context: int | list[int],
                        config: DecodeConfig, splits: int | None = None,
                        min_split_tokens: int | None = None,
                        backend: TritonAttentionBackend | None = None) -> dict:
    """Decode attention of one step over several layers, each with its own KV pages, as
    one CUDA graph (as the model's decode graph runs it): time per layer, launch gaps and
    DRAM reads included. ``context``: every sequence's, or each one's (``batch`` of them).
    ``splits`` and ``min_split_tokens``: None takes the backend's; with ``backend`` its
    own split counts and balancing (``TritonAttentionBackend._decode``'s arguments)."""
    contexts = [context] * batch if isinstance(context, int) else list(context)
    backend = backend or TritonAttentionBackend(balance_splits=1)
    if min_split_tokens is None:
        min_split_tokens = backend.min_split_tokens
    q_heads, kv_heads, head_dim = HEAD_SHAPES[shape]
    kv_bytes = 2 * sum(contexts) * kv_heads * head_dim * DTYPE.itemsize
    layers = max(1, min(_AB_MAX_LAYERS, math.ceil(_AB_MIN_GRAPH_BYTES / kv_bytes)))
    k_cache, v_cache, tables = paged_cache(contexts * layers, kv_heads, head_dim)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, q_heads, head_dim, dtype=DTYPE, device="cuda")
    out = torch.empty_like(q)
    splitting = backend.decode_splitting(batch, kv_heads, q.device)
    splitting["min_split_tokens"] = min_split_tokens
    if splits is not None:
        splitting.update(num_splits=splits, split_cap=splits)
    splits = splitting["num_splits"]

    def step() -> None:
        for layer_tables in tables.split(batch):
            decode_attention(q, k_cache, v_cache, layer_tables, seq_lens, out, head_dim**-0.5,
                             config=config, **splitting)  # fmt: skip

    ms = do_bench_cudagraph(step, rep=50) / layers
    return {"kernel": "decode_layers", "shape": shape, "batch": batch,
            "context": context if isinstance(context, int) else max(contexts),
            "mean_context": sum(contexts) / batch, **splitting, "splits": splits,
            "config": config.__dict__,
            "layers": layers, "us_per_layer": ms * 1e3, "kv_gbs": kv_bytes / ms / 1e6}  # fmt: skip


def decode_ab(log: Callable[[dict], dict], copy_gbs: float) -> list[dict]:
    """One-launch vs two-launch decode per layer at ``DECODE_AB_POINTS`` (34B heads)."""
    tiles = default_decode_config(128, torch.device("cuda"))
    rows = []
    for batch, context in DECODE_AB_POINTS:
        two = _guarded(bench_decode_layers, "34b", batch, context,
                       dataclasses.replace(tiles, one_launch=False))  # fmt: skip
        one = _guarded(bench_decode_layers, "34b", batch, context,
                       dataclasses.replace(tiles, one_launch=True))  # fmt: skip
        row = {"kernel": "decode_ab", "batch": batch, "context": context,
               "splits": one.get("splits"), "layers": one.get("layers"),
               "two_launch_us": two.get("us_per_layer"), "one_launch_us": one.get("us_per_layer"),
               "one_launch_of_copy": one.get("kv_gbs", 0) / copy_gbs,
               "errors": [r["error"] for r in (two, one) if "error" in r]}  # fmt: skip
        if not row["errors"]:
            row["speedup"] = row["two_launch_us"] / row["one_launch_us"]
        rows.append(log(row))
    return rows


# Small-batch points where tokens per split are A/B'd (both head shapes share 8 KV heads; the
# merge kernel differs with their q heads).
SPLIT_AB_POINTS = [(shape, b, c) for shape in ("8b", "34b") for b in (1, 2, 4, 8)
                   for c in (1024, 4096)]
# (tokens per split, K/V tile) of the two-launch path: the earlier default (two 64-token
# tiles a split), the backend's (one), and one 128-token tile (the one-launch sweep's best
# at batch 1-4).
SPLIT_AB_VARIANTS = {"128/64": (128, 64), "64/64": (64, 64), "128/128": (128, 128)}


def decode_split_ab(log: Callable[[dict], dict]) -> list[dict]:
    """Two-launch decode (the default) per layer at each of ``SPLIT_AB_VARIANTS``; speedup:
    the earlier default's time over the backend's."""
    tiles = dataclasses.replace(default_decode_config(128, torch.device("cuda")),
                                one_launch=False)
    rows = []
    for shape, batch, context in SPLIT_AB_POINTS:
        timed = {name: _guarded(bench_decode_layers, shape, batch, context,
                                dataclasses.replace(tiles, block_n=tile), None, tokens)
                 for name, (tokens, tile) in SPLIT_AB_VARIANTS.items()}  # fmt: skip
        row = {"kernel": "decode_split_ab", "shape": shape, "batch": batch, "context": context,
               "splits": timed["64/64"].get("splits"),
               "us_per_layer": {name: r.get("us_per_layer") for name, r in timed.items()},
               "errors": [r["error"] for r in timed.values() if "error" in r]}  # fmt: skip
        if not row["errors"]:
            row["speedup"] = timed["128/64"]["us_per_layer"] / timed["64/64"]["us_per_layer"]
        rows.append(log(row))
    return rows


# --------------------------------------------------------------------------- decode balance

# Decode batches x context layouts (mean about 600 tokens) where balancing long contexts
# over more splits (``TritonAttentionBackend.balance_splits``) is timed against split
# counts from the batch size alone.
BALANCE_BATCHES = (16, 32, 48, 64, 128, 256)
BALANCE_VARIANTS = (1, 8)  # 1: off; 8: the default (``num_kv_splits`` bounds the grid)


def balance_layouts(batch: int) -> dict[str, list[int]]:
    """Contexts alike; evenly spaced over 60-1140 tokens; one of 8K beside 512s."""
    from bench_engine import ragged_contexts  # beside this script, which Python puts on the path

    return {"even": [600] * batch, "spread_0.9": ragged_contexts(batch, 600, 0.9),
            "one_8k": ragged_contexts(batch, 512, 0.0, 8192)}


def decode_balance(log: Callable[[dict], dict]) -> list[dict]:
    """Decode attention per layer (34B heads, the default two-launch path) at every
    ``BALANCE_BATCHES`` x ``balance_layouts`` point with each ``BALANCE_VARIANTS``;
    ``vs_off``: time with balancing off over time with it."""
    tiles = default_decode_config(128, torch.device("cuda"))
    rows = []
    for batch in BALANCE_BATCHES:
        for layout, contexts in balance_layouts(batch).items():
            timed = {variant: _guarded(bench_decode_layers, "34b", batch, contexts, tiles, None,
                                       None, TritonAttentionBackend(balance_splits=variant))
                     for variant in BALANCE_VARIANTS}  # fmt: skip
            off = timed[1].get("us_per_layer")
            row = {"kernel": "decode_balance", "batch": batch, "layout": layout,
                   "max_context": max(contexts), "mean_context": sum(contexts) / batch,
                   "us_per_layer": {v: r.get("us_per_layer") for v, r in timed.items()},
                   "splits": {v: r.get("splits") for v, r in timed.items()},
                   "errors": [r["error"] for r in timed.values() if "error" in r]}  # fmt: skip
            if not row["errors"]:
                row["vs_off"] = {v: off / r["us_per_layer"] for v, r in timed.items()}
            rows.append(log(row))
    return rows


# Latency candidates for small batches at 1K (tokens per split, tile): fewer and fatter
# programs, or more and thinner; and tiles for the bandwidth-bound batch 256.
SMALL_BATCH_SWEEP = [(m, DecodeConfig(n, 4, 2)) for m, n in
                     [(64, 32), (64, 64), (128, 64), (128, 128), (256, 64), (256, 128)]]
LARGE_BATCH_SWEEP = [(s, DecodeConfig(n, w, st)) for s, n, w, st in
                     [(1, 64, 4, 2), (1, 64, 4, 3), (1, 128, 8, 2), (1, 32, 4, 4), (2, 64, 4, 2)]]


def decode_latency_sweep(log: Callable[[dict], dict]) -> list[dict]:
    """One-launch decode per layer: split sizes and tiles at batch 1..8 / 1K context, and
    tiles and split counts at batch 256 / 1K (its KV read should run at the copy rate)."""
    rows = []
    for batch in (1, 2, 4, 8):
        for min_split, config in SMALL_BATCH_SWEEP:
            rows.append(log(_guarded(bench_decode_layers, "34b", batch, 1024, config, None,
                                     min_split)))  # fmt: skip
    for splits, config in LARGE_BATCH_SWEEP:
        rows.append(log(_guarded(bench_decode_layers, "34b", 256, 1024, config, splits)))
    return rows


def run_decode_ab(log: Callable[[dict], dict]) -> dict:
    ceilings = log({"ceilings": measure_ceilings()})["ceilings"]
    return {"ceilings": ceilings, "decode_ab": decode_ab(log, ceilings["copy_gbs"]),
            "decode_split_ab": decode_split_ab(log), "decode_sweep": decode_latency_sweep(log)}


def decode_fits(batch: int, context: int, shape: str, limit_gb: float) -> bool:
    _, kv_heads, head_dim = HEAD_SHAPES[shape]
    return 2 * batch * context * kv_heads * head_dim * 2 / 1e9 <= limit_gb


# --------------------------------------------------------------------------- prefill


def extend_inputs(shape: str, prefix: int, new: int):
    q_heads, kv_heads, head_dim = HEAD_SHAPES[shape]
    k_cache, v_cache, tables = paged_cache([prefix + new], kv_heads, head_dim)
    meta = extend_meta(prefix, new, tables)
    q = torch.randn(new, q_heads, head_dim, dtype=DTYPE, device="cuda")
    k = torch.randn(new, kv_heads, head_dim, dtype=DTYPE, device="cuda")
    v = torch.randn(new, kv_heads, head_dim, dtype=DTYPE, device="cuda")
    return q, k, v, k_cache, v_cache, meta


def extend_meta(prefix: int, new: int, tables: torch.Tensor) -> AttentionMetadata:
    """One sequence of ``new`` tokens over ``prefix`` cached ones, on the tables' device."""
    device = tables.device
    return AttentionMetadata(
        num_seqs=1,
        num_decode_seqs=0,
        query_start_loc=torch.tensor([0, new], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([prefix + new], dtype=torch.int32, device=device),
        block_tables=tables,
        slot_mapping=torch.full((new,), -1, dtype=torch.int64, device=device),
        max_query_len=new,
        max_seq_len=prefix + new,
        block_size=PAGE_SIZE,
    )


def attention_flops(q_heads: int, head_dim: int, prefix: int, new: int) -> float:
    # QK^T and PV, 2 FLOPs per MAC each, over the causal half of the new x new block.
    return 4.0 * q_heads * head_dim * (new * prefix + new * (new + 1) / 2)


def bench_prefill(shape: str, prefix: int, new: int, config: ExtendConfig | None = None,
                  launch_sms: int | None = None) -> dict:
    """``launch_sms``: the SMs the split count counts (the caller runs it on a partition
    of that many); None is the whole GPU."""
    q_heads, kv_heads, head_dim = HEAD_SHAPES[shape]
    q, k, v, k_cache, v_cache, meta = extend_inputs(shape, prefix, new)
    meta = dataclasses.replace(meta, launch_sms=launch_sms)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    run = lambda: extend_attention(q, k, v, out, k_cache, v_cache, meta, scale, 0, config)
    ms = do_bench(run, warmup=10, rep=100)
    flops = attention_flops(q_heads, head_dim, prefix, new)
    row = {"kernel": "prefill", "shape": shape, "prefix": prefix, "new": new, "ms": ms,
           "tflops": flops / ms / 1e9}  # fmt: skip
    if config is not None:  # the split count kv_splits=0 resolved to
        row["splits"] = extend_grid(config, meta, q_heads, q_heads // kv_heads, 0, q.device)[1]
    if prefix == 0:
        row["sdpa_ms"] = bench_sdpa(q, k, v, scale)
        row["sdpa_tflops"] = flops / row["sdpa_ms"] / 1e9
    return row


def bench_sdpa(q, k, v, scale: float) -> float:
    """torch SDPA's flash kernel on contiguous K/V: what a non-paged kernel achieves."""
    group = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    kt, vt = (x.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0) for x in (k, v))
    run = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return do_bench(run, warmup=10, rep=100)
    except RuntimeError:  # no flash kernel for this shape/version
        return float("nan")


# --------------------------------------------------------------------------- fused ops


def fused_cases(tokens: int) -> list[tuple[str, Callable, Callable, int]]:
    """(name, triton fn, baseline fn, bytes moved) at 34B-like sizes; the baseline is the
    torch reference unless ``BASELINE_KEYS`` names another."""
    hidden, inter, (q_heads, kv_heads, head_dim) = 8192, 22016, HEAD_SHAPES["34b"]
    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    res, w = torch.randn_like(x), torch.randn(hidden, dtype=DTYPE, device="cuda")
    gate_up = torch.randn(tokens, 2 * inter, dtype=DTYPE, device="cuda")
    q = torch.randn(tokens, q_heads, head_dim, dtype=DTYPE, device="cuda")
    k = torch.randn(tokens, kv_heads, head_dim, dtype=DTYPE, device="cuda")
    pos = torch.randint(0, 16384, (tokens,), device="cuda")
    cos_sin = torch.randn(16384, head_dim, device="cuda")
    act = x.numel() * 2
    qk = (q.numel() + k.numel()) * 2
    return [
        *_rope_store_case(tokens, q.clone(), k.clone(), pos, cos_sin),
        ("rms_norm", lambda: triton_fused.rms_norm(x, w, 1e-5),
         lambda: reference.rms_norm(x, w, 1e-5), 2 * act),
        ("fused_add_rms_norm", lambda: triton_fused.fused_add_rms_norm(x, res, w, 1e-5),
         lambda: reference.fused_add_rms_norm(x, res, w, 1e-5), 4 * act),
        ("silu_and_mul", lambda: triton_fused.silu_and_mul(gate_up),
         lambda: reference.silu_and_mul(gate_up), gate_up.numel() * 3),
        ("apply_rope", lambda: triton_fused.apply_rope(q, k, pos, cos_sin),
         lambda: reference.apply_rope(q, k, pos, cos_sin), 2 * qk),
    ]  # fmt: skip


# Fused ops timed against something other than their torch reference.
BASELINE_KEYS = {"rope_store_kv": "unfused_ms"}


def _rope_store_case(tokens, q, k, pos, cos_sin) -> list[tuple[str, Callable, Callable, int]]:
    """The fused rotary + KV store (rotating ``q`` and ``k`` in place) against the two Triton
    ops it replaces (three launches), at a slot per token in a 34B-shaped paged cache."""
    v = torch.randn_like(k)
    pages = triton.cdiv(tokens, PAGE_SIZE)
    k_cache = torch.empty(pages, PAGE_SIZE, *k.shape[1:], dtype=DTYPE, device="cuda")
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(pages * PAGE_SIZE, device="cuda")[:tokens]
    nbytes = (2 * q.numel() + 4 * k.numel()) * 2  # q, k read + written; v read; k, v stored

    def unfused() -> None:
        _, k_rot = triton_fused.apply_rope(q, k, pos, cos_sin)
        triton_fused.store_kv(k_rot, v, k_cache, v_cache, slots)

    def fused() -> None:
        triton_fused.rope_store_kv(q, k, v, pos, cos_sin, k_cache, v_cache, slots)

    return [("rope_store_kv", fused, unfused, nbytes)]


def bench_fused(tokens: int) -> list[dict]:
    rows = []
    for name, ours, torch_fn, nbytes in fused_cases(tokens):
        ms, baseline_ms = do_bench(ours), do_bench(torch_fn)
        rows.append({"kernel": name, "tokens": tokens, "ms": ms,
                     BASELINE_KEYS.get(name, "torch_ms"): baseline_ms,
                     "gbs": nbytes / ms / 1e6, "speedup": baseline_ms / ms})  # fmt: skip
    return rows


# --------------------------------------------------------------------------- sweeps


EXTEND_SWEEP = [ExtendConfig(m, n, w, s) for m, n, w, s in [
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
    (128, 64, 4, 3), (64, 32, 4, 4), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4),
    (64, 128, 4, 3), (128, 32, 8, 4),
]]  # fmt: skip
# Prompt shapes the sweep times each extend config on: a whole prompt, and chunks over a
# cached prefix (long-context serving spends most of its attention there).
EXTEND_SWEEP_SHAPES = ((0, 8192), (16384, 2048), (8192, 512))
# The layouts (GQA packing x prefix splits, 0 = auto) are timed at the H200's default tiles
# on these, adding the 256-token chunks multiplexing's mixed steps take at 12-15K context
# and the 64-128-token ones graph steps leave beside a large decode batch (a grid under
# half a wave of programs, where the auto split count splits).
# The plain layout there repeats three tile-sweep points: a check of the run's noise.
EXTEND_VARIANT_SHAPES = EXTEND_SWEEP_SHAPES + ((12288, 256), (15360, 256), (16384, 64),
                                               (16384, 128), (4096, 128))
EXTEND_VARIANTS = [(pack, splits) for pack in (False, True) for splits in (1, 2, 4, 0)]
DECODE_SWEEP = [DecodeConfig(n, w, s) for n, w, s in [
    (64, 4, 2), (32, 4, 3), (64, 4, 3), (128, 4, 2), (32, 2, 4), (64, 8, 2),
]]  # fmt: skip


def sweep(log: Callable[[dict], None]) -> list[dict]:
    rows = []
    rows = sweep_extend(log)
    backend = TritonAttentionBackend()
    for cfg in DECODE_SWEEP:
        for batch, context in ((1, 32768), (16, 8192), (64, 1024), (256, 8192)):
            row = _guarded(bench_decode, "34b", batch, context, backend, cfg)
            rows.append(log({"sweep": "decode", "config": cfg.__dict__, **row}))
    return rows


def sweep_extend(log: Callable[[dict], None],
                 measure: Callable[..., dict] | None = None) -> list[dict]:
    """Every tile config on the sweep shapes, then every layout at the default tiles.
    ``measure``: how one point is timed (``bench_prefill``)."""
    measure = measure or bench_prefill
    points = [(cfg, shape) for cfg in EXTEND_SWEEP for shape in EXTEND_SWEEP_SHAPES]
    points += [(cfg, shape) for cfg in extend_variants() for shape in EXTEND_VARIANT_SHAPES]
    rows = []
    for cfg, (prefix, new) in points:
        row = _guarded(measure, "34b", prefix, new, cfg)
        rows.append(log({"sweep": "extend", "config": cfg.__dict__, **row}))
    return rows


# Chunks over a cached prefix as mixed steps take them, across the tile counts whose grids
# fill a whole number of waves or not (codellama-34b: 64 programs a 128-token tile).
EXTEND_WAVE_CHUNKS = (64, 128, 192, 256, 288, 320, 384, 448, 512, 576, 640, 1024)
EXTEND_WAVE_PREFIXES = (4096, 8192, 12288, 16384)
EXTEND_WAVE_SPLITS = (1, 2, 4)
# On a partition the rule may pick more splits (fewer SMs, the same programs): 8 is timed too.
EXTEND_WAVE_PARTITION_SPLITS = (1, 2, 4, 8)


def extend_waves(log: Callable[[dict], dict], sms: int | None = None) -> dict:
    """Each chunk x prefix at 1, 2 and 4 prefix splits (the default tiles), with the count
    the auto rule picks, and per point the auto pick's time over one split's. ``sms``: run
    every launch on the prefill side of a green-context partition of that many SMs (and
    8 splits too), the rule counting them as the engine's launches on it do."""
    # one launch a chunk: what the split rule's cost model is fitted to
    tiles = dataclasses.replace(default_extend_config(128, torch.device("cuda")),
                                tail_tiles=False)
    split_counts = EXTEND_WAVE_SPLITS if sms is None else EXTEND_WAVE_PARTITION_SPLITS
    rows, picks = [], []
    for prefix in EXTEND_WAVE_PREFIXES:
        for new in EXTEND_WAVE_CHUNKS:
            timed = {}
            for splits in split_counts:
                row = _guarded(bench_prefill, "34b", prefix, new,
                               dataclasses.replace(tiles, kv_splits=splits), sms)
                timed[splits] = row.get("ms")
                rows.append(log({"sweep": "extend_waves", "launch_sms": sms, **row}))
            auto = _guarded(lambda *args: auto_extend_splits(*args, launch_sms=sms),
                            prefix, new, tiles)
            picks.append(log({"prefix": prefix, "new": new, "launch_sms": sms, **auto,
                              **_pick_ratio(timed, auto)}))
    return {"extend_config": tiles.__dict__, "launch_sms": sms, "rows": rows, "auto": picks}


def extend_waves_on_partitions(log: Callable[[dict], dict], prefill_sms: list[int]) -> dict:
    """``extend_waves`` on the prefill side of one green-context split per count, on its
    stream; stops with the reason where green contexts cannot be made (an emulated
    partition would time the whole GPU under a partition's name)."""
    from pdserve.gpu.partitions import PartitionSet

    total = torch.cuda.get_device_properties(0).multi_processor_count
    pset = PartitionSet.for_device(0, [total - sms for sms in prefill_sms])
    if pset.emulated:
        sys.exit(f"--extend-waves-sms needs green contexts: {pset.emulation_reason}")
    runs = []
    for part in pset.choices():
        with torch.cuda.stream(part.prefill_stream):
            runs.append(extend_waves(log, part.prefill_sms))
    return {"partitions": pset.describe(), "runs": runs}


def auto_extend_splits(prefix: int, new: int, tiles: ExtendConfig,
                       device: str = "cuda", launch_sms: int | None = None) -> dict:
    """The split count kv_splits=0 resolves to on this chunk (nothing launched)."""
    q_heads, kv_heads, _ = HEAD_SHAPES["34b"]
    tables = torch.zeros(1, triton.cdiv(prefix + new, PAGE_SIZE), dtype=torch.int32,
                         device=device)
    meta = dataclasses.replace(extend_meta(prefix, new, tables), launch_sms=launch_sms)
    config = dataclasses.replace(tiles, kv_splits=0)
    return {"auto_splits": extend_grid(config, meta, q_heads, q_heads // kv_heads, 0,
                                       tables.device)[1]}


def _pick_ratio(timed: dict[int, float | None], auto: dict) -> dict:
    picked, one = timed.get(auto.get("auto_splits")), timed.get(1)
    best = min((s for s in timed if timed[s]), key=lambda s: timed[s], default=None)
    if not picked or not one:
        return {}
    return {"auto_over_one": picked / one, "fastest_splits": best}


def extend_variants() -> list[ExtendConfig]:
    tiles = default_extend_config(128, torch.device("cuda"), hopper=True)
    # layouts of one launch a chunk (the tail launch is timed by bench_mixed_step.py)
    return [dataclasses.replace(tiles, pack_gqa=pack, kv_splits=splits, tail_tiles=False)
            for pack, splits in EXTEND_VARIANTS]  # fmt: skip


def _guarded(fn: Callable[..., dict], *args: object) -> dict:
    """A config that fails to compile or launch (e.g. too much shared memory) is a result."""
    try:
        return fn(*args)
    except Exception as err:  # any compile or launch error is recorded, not fatal
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    finally:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- main


def run_all(args: argparse.Namespace, log: Callable[[dict], dict]) -> dict:
    ceilings = measure_ceilings()
    log({"ceilings": ceilings})
    backend = TritonAttentionBackend()
    batches, contexts = ((1, 64), (1024, 8192)) if args.quick else (DECODE_BATCHES, CONTEXTS)
    decode, prefill = [], []
    for shape in HEAD_SHAPES:
        for batch in batches:
            for context in contexts:
                if decode_fits(batch, context, shape, args.max_kv_gb):
                    row = _guarded(bench_decode, shape, batch, context, backend)
                    row.setdefault("of_copy", row.get("kv_gbs", 0) / ceilings["copy_gbs"])
                    decode.append(log(row))
        chunks = [(0, n) for n in contexts] + [(16384, 2048)]
        for prefix, new in chunks:
            row = _guarded(bench_prefill, shape, prefix, new)
            row.setdefault("of_gemm", row.get("tflops", 0) / ceilings["gemm_tflops"])
            prefill.append(log(row))
    fused = [log(r) for t in ((1, 4096) if args.quick else (1, 64, 4096)) for r in bench_fused(t)]
    result = {"ceilings": ceilings, "decode": decode, "prefill": prefill, "fused": fused}
    if args.sweep:
        result["sweep"] = sweep(log)
    return result


def run_extend_sweep(log: Callable[[dict], dict]) -> dict:
    return {"ceilings": log({"ceilings": measure_ceilings()}), "sweep": sweep_extend(log)}


def environment() -> dict:
    return {
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        **revision_fields(),
        "git_dirty": bool(_git("status", "--porcelain", "--", "pdserve/ops")),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "decode_config_d128": default_decode_config(128, torch.device("cuda")).__dict__,
        "extend_config_d128": default_extend_config(128, torch.device("cuda")).__dict__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="a few points only")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    parser.add_argument("--extend-sweep-only", action="store_true",
                        help="only the prefill-attention sweep: tiles, then GQA packing x "
                             "prefix splits (a few minutes)")
    parser.add_argument("--extend-waves", action="store_true",
                        help="only the extend kernel's prefix splits on chunks over a prefix: "
                             "1, 2 and 4 against the auto count (about a minute)")
    parser.add_argument("--extend-waves-sms", type=lambda text: [int(x) for x in text.split(",")],
                        help="with --extend-waves: time it on the prefill side of green-context "
                             "partitions of these SM counts instead (e.g. 108,84)")
    parser.add_argument("--decode-ab", action="store_true",
                        help="only decode attention: one launch vs two per layer, and a "
                             "sweep of its split sizes and tiles")
    parser.add_argument("--decode-balance", action="store_true",
                        help="only decode attention: long contexts balanced over more splits "
                             "against split counts from the batch size alone")
    parser.add_argument("--max-kv-gb", type=float, default=40.0,
                        help="skip decode points whose KV cache is larger")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA GPU")

    def log(row: dict) -> dict:
        print(json.dumps(row), flush=True)
        return row

    if args.decode_ab:
        results = run_decode_ab(log)
    elif args.decode_balance:
        results = {"decode_balance": decode_balance(log)}
    elif args.extend_sweep_only:
        results = run_extend_sweep(log)
    elif args.extend_waves and args.extend_waves_sms:
        results = {"extend_waves_partitions": extend_waves_on_partitions(log,
                                                                         args.extend_waves_sms)}
    elif args.extend_waves:
        results = {"extend_waves": extend_waves(log)}
    else:
        results = run_all(args, log)
    record = {"environment": environment(), **results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
