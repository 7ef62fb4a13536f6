"""Decode attention of this tree against the same module of an earlier revision, per layer,
both timed in one process on one GPU (machines of one GPU type differ by several percent,
so a kernel change is judged only against its baseline in the same run).

The decode kernel runs as the engine's decode graphs run it: the rotary embedding and the
new token's K/V store fused in, split counts and balancing from each backend's defaults,
several layers with their own pages in one CUDA graph (KV larger than L2).

    git show <rev>:pdserve/ops/triton_attention.py > /tmp/attention_<rev>.py
    python benchmarks/bench_decode_revisions.py --baseline /tmp/attention_<rev>.py \\
        --baseline-revision <rev> --out benchmarks/results/decode_revisions_h200_<rev>.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
from bench_kernels import DTYPE, HEAD_SHAPES, PAGE_SIZE, balance_layouts, environment, paged_cache
from triton.testing import do_bench_cudagraph

from pdserve.ops import triton_attention
from pdserve.ops.metadata import AttentionMetadata

# (batch, layout): contexts alike at 1K, and the layouts of ``balance_layouts``.
POINTS = [(1, "1k"), (9, "1k"), (16, "1k"), (32, "1k"), (48, "1k"), (128, "1k"), (256, "1k"),
          (48, "one_8k"), (48, "spread_0.9"), (128, "one_8k")]
_MIN_GRAPH_BYTES = 256e6
_MAX_LAYERS = 48


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def contexts_of(batch: int, layout: str) -> list[int]:
    return [1024] * batch if layout == "1k" else balance_layouts(batch)[layout]


def time_layer(module, contexts: list[int], shape: str = "34b") -> float:
    """Microseconds a layer of fused-rope decode attention takes with ``module``'s backend."""
    q_heads, kv_heads, head_dim = HEAD_SHAPES[shape]
    batch = len(contexts)
    kv_bytes = 2 * sum(contexts) * kv_heads * head_dim * DTYPE.itemsize
    layers = max(1, min(_MAX_LAYERS, math.ceil(_MIN_GRAPH_BYTES / kv_bytes)))
    k_cache, v_cache, tables = paged_cache(contexts * layers, kv_heads, head_dim)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, q_heads, head_dim, dtype=DTYPE, device="cuda")
    k = torch.randn(batch, kv_heads, head_dim, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    positions = (seq_lens - 1).long()
    cos_sin = torch.randn(max(contexts) + 1, head_dim, dtype=torch.float32, device="cuda")
    backend = module.TritonAttentionBackend()
    metas, last = [], seq_lens.long() - 1
    for layer_tables in tables.split(batch):
        pages = layer_tables[torch.arange(batch, device="cuda"), last // PAGE_SIZE]
        slots = pages.long() * PAGE_SIZE + last % PAGE_SIZE
        metas.append(AttentionMetadata(
            num_seqs=batch, num_decode_seqs=batch,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            seq_lens=seq_lens, block_tables=layer_tables, slot_mapping=slots, max_query_len=1,
            max_seq_len=max(contexts), block_size=PAGE_SIZE))

    def step() -> None:
        for meta in metas:
            backend.rope_store_attend(q, k, v, positions, cos_sin, k_cache, v_cache, meta,
                                      head_dim**-0.5)

    step()
    return do_bench_cudagraph(step, rep=50) / layers * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="an earlier revision's pdserve/ops/triton_attention.py")
    parser.add_argument("--baseline-revision", required=True)
    parser.add_argument("--repeats", type=int, default=2, help="alternating timings of each")
    parser.add_argument("--shape", choices=sorted(HEAD_SHAPES), default="34b",
                        help="heads of codellama-34b (64 q, 8 kv) or llama3-8b (32 q, 8 kv)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_revisions needs a CUDA GPU")
    modules = {"this": triton_attention, "baseline": load_module(args.baseline)}
    rows = []
    for batch, layout in POINTS:
        contexts = contexts_of(batch, layout)
        timed = {name: [] for name in modules}
        for _ in range(args.repeats):
            for name, module in modules.items():
                timed[name].append(time_layer(module, contexts, args.shape))
        row = {"batch": batch, "layout": layout, "us_per_layer": timed,
               "this_over_baseline": min(timed["this"]) / min(timed["baseline"])}
        print(json.dumps(row), flush=True)
        rows.append(row)
    record = {"environment": environment(), "baseline_revision": args.baseline_revision,
              "head_shape": dict(zip(("q_heads", "kv_heads", "head_dim"),
                                     HEAD_SHAPES[args.shape], strict=True)),
              "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
