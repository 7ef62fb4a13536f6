"""Kernel launches of one decode layer, counted without a GPU (or with one).

Builds one decoder layer of a preset architecture with random weights, gives it a decode
batch over a paged cache, and counts what one call launches (``pdserve.ops.launch_count``):
the torch-reference path (``PDSERVE_REFERENCE_OPS=1``, what a GPU runs without Triton), the
Triton path (on a CPU through Triton's interpreter; set ``TRITON_INTERPRET=1``) and the fused
decode-GEMV path of ``--decode-gemv on`` (batches of at most 8).

    TRITON_INTERPRET=1 python benchmarks/count_launches.py --model tiny --batch 4
    python benchmarks/count_launches.py --model llama3-8b --device cuda   # on a GPU
    TRITON_INTERPRET=1 python benchmarks/count_launches.py --paths triton,gemv --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
from collections.abc import Callable

import torch

from pdserve.model.arch import PRESETS, ModelArch
from pdserve.model.llama import LlamaDecoderLayer, rope_cos_sin_cache
from pdserve.model.testing import build_metadata, make_kv_caches
from pdserve.ops import dispatch
from pdserve.ops.launch_count import LaunchCount, count_calls
from pdserve.ops.registry import get_attention_backend


def decode_layer_call(arch: ModelArch, batch: int, context: int, device: str,
                      dtype: torch.dtype, backend_name: str, gemv: bool = False
                      ) -> Callable[[], object]:
    """A no-argument call of one middle decoder layer (it has a residual) on a decode batch:
    ``batch`` sequences with ``context`` tokens cached, one new token each; ``gemv``: the
    layer's fused-GEMV form (``forward_gemv``, which takes the residual stream)."""
    torch.manual_seed(0)
    backend = get_attention_backend(backend_name, device)
    with torch.device(device):
        layer = LlamaDecoderLayer(arch, backend).to(dtype)
    block_size = 16
    pages = math.ceil((context + 1) / block_size)
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(batch)]
    meta = build_metadata([context] * batch, [1] * batch, tables, block_size, device)
    kv = make_kv_caches(dataclasses.replace(arch, num_layers=1), 1 + batch * pages, block_size,
                        dtype, device)[0]
    cos_sin = rope_cos_sin_cache(arch, context + 1, torch.device(device))
    hidden = torch.randn(batch, arch.hidden_size, device=device, dtype=dtype)
    residual = torch.randn_like(hidden)
    positions = torch.full((batch,), context, device=device)

    def call() -> object:
        with torch.inference_mode():
            if gemv:
                return layer.forward_gemv(residual, positions, meta, kv, cos_sin)
            return layer(hidden, residual, positions, meta, kv, cos_sin)

    return call


def count_decode_layer(arch: ModelArch, batch: int, context: int, device: str,
                       dtype: torch.dtype, path: str) -> LaunchCount:
    """Launches of one decode-layer call on ``path`` "reference", "triton" or "gemv"."""
    call = decode_layer_call(arch, batch, context, device, dtype,
                             "torch" if path == "reference" else "triton", gemv=path == "gemv")
    with _ops_for(path, device):
        call()  # first call: Triton compiles (or the interpreter warms up) outside the count
        return count_calls(call)


def _ops_for(path: str, device: str) -> contextlib.AbstractContextManager:
    if path == "reference":
        return dispatch.reference_ops()
    if device == "cpu":
        return dispatch.interpreted_triton_ops()
    return contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--paths", default="reference,triton")
    args = parser.parse_args()
    arch, dtype = PRESETS[args.model], getattr(torch, args.dtype)
    for path in args.paths.split(","):
        count = count_decode_layer(arch, args.batch, args.context, args.device, dtype, path)
        print(json.dumps({"model": args.model, "device": args.device, "path": path,
                          "batch": args.batch, "launches_per_layer": count.total,
                          "triton_launches": count.triton, "by_kernel": dict(count.by_name)}))


if __name__ == "__main__":
    main()
