"""Block-free KV transfer against block-by-block, prefill pool to decode pool over TCP.

P/D-Serve's claim: gathering a request's scattered pages into one contiguous buffer and
sending it as one stream beats sending page by page (the link carries many small messages
otherwise). Both variants here use the same wire format, sender and receiver
(``pdserve/transfer/tcp.py``) and end with the KV in the receiver's own pages:

- ``block_free``: one ``gather_blocks`` (one kernel for all layers), one message, one
  ``scatter_blocks``;
- ``per_block``: one message per (layer, page) - that page's K and V rows - each scattered
  into its destination page on arrival.

The clock runs from the first gather or send until the last byte is in the receiver's pages;
both ends live in this process (loopback) with a thread per side, as in the engine. The
result is checked bit for bit. On a GPU (``--device cuda``) the pools are on the device and
every message is handed to the sender as a device tensor, as the engine does: the transport
stages it through pinned host memory (a ``.cpu()`` here would time a pageable copy the engine
never makes instead). The receiver delivers CPU buffers, scattered to the device, as in the
engine.

    python benchmarks/bench_kv_transfer.py --model llama3-8b --tokens 512,2048,8192 \\
        --out benchmarks/results/kv_transfer_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

# Runnable from a plain checkout: the package sits one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.cache.kv_pool import allocate_kv_pool  # noqa: E402
from pdserve.model.arch import PRESETS  # noqa: E402
from pdserve.transfer import gather_blocks, scatter_blocks  # noqa: E402
from pdserve.transfer.tcp import TcpKVReceiver, TcpKVSender  # noqa: E402

BLOCK_SIZE = 16


def make_pools(arch, num_tokens: int, device: torch.device, dtype: torch.dtype):
    """A source pool holding the request in shuffled pages, and an empty destination."""
    num_pages = -(-num_tokens // BLOCK_SIZE)
    pool_pages = 2 * num_pages + 8
    source = allocate_kv_pool(arch, pool_pages, BLOCK_SIZE, dtype, device)
    for k, v in source:
        k.normal_()
        v.normal_()
    dest = allocate_kv_pool(arch, pool_pages, BLOCK_SIZE, dtype, device)
    generator = torch.Generator().manual_seed(num_tokens)
    pages = torch.randperm(pool_pages, generator=generator)
    return source, pages[:num_pages].tolist(), dest, pages[num_pages:2 * num_pages].tolist()


def block_free(source, src_pages, dest, dst_pages, num_tokens, sender, receiver) -> None:
    buffer = gather_blocks(source, src_pages, num_tokens)
    sender.send(receiver.address, "whole", buffer)  # a device buffer is staged by the sender
    scatter_blocks(receiver.recv("whole", timeout=120), dest, dst_pages)


def per_block(source, src_pages, dest, dst_pages, num_tokens, sender, receiver) -> None:
    messages = [(layer, i) for layer in range(len(source)) for i in range(len(src_pages))]
    consumer = threading.Thread(target=_scatter_pages,
                                args=(messages, dest, dst_pages, num_tokens, receiver))
    consumer.start()
    for layer, i in messages:
        rows = min(BLOCK_SIZE, num_tokens - i * BLOCK_SIZE)
        k, v = source[layer]
        page = torch.stack((k[src_pages[i], :rows], v[src_pages[i], :rows]))[None]
        sender.send(receiver.address, f"{layer}/{i}", page)
    consumer.join()


def _scatter_pages(messages, dest, dst_pages, num_tokens, receiver) -> None:
    for layer, i in messages:
        page = receiver.recv(f"{layer}/{i}", timeout=120)[0].to(dest[0][0].device)
        rows = page.shape[1]
        k, v = dest[layer]
        k[dst_pages[i], :rows] = page[0]
        v[dst_pages[i], :rows] = page[1]


VARIANTS = {"block_free": block_free, "per_block": per_block}


def same_kv(source, src_pages, dest, dst_pages, num_tokens) -> bool:
    return torch.equal(gather_blocks(source, src_pages, num_tokens),
                       gather_blocks(dest, dst_pages, num_tokens))


def measure(variant, arch, num_tokens, device, dtype, repeats) -> dict:
    times = []
    with TcpKVReceiver() as receiver, TcpKVSender() as sender:
        for _ in range(repeats + 1):  # the first round warms up the connection
            source, src_pages, dest, dst_pages = make_pools(arch, num_tokens, device, dtype)
            _sync(device)
            start = time.perf_counter()
            VARIANTS[variant](source, src_pages, dest, dst_pages, num_tokens, sender, receiver)
            _sync(device)
            times.append(time.perf_counter() - start)
            if not same_kv(source, src_pages, dest, dst_pages, num_tokens):
                raise AssertionError(f"{variant}: received KV differs from what was sent")
    num_bytes = gather_blocks(source, src_pages, num_tokens).numel() * dtype.itemsize
    median = statistics.median(times[1:])
    messages = 1 if variant == "block_free" else arch.num_layers * len(src_pages)
    return {"variant": variant, "num_tokens": num_tokens, "num_bytes": num_bytes,
            "messages": messages, "median_ms": median * 1e3,
            "all_ms": [t * 1e3 for t in times[1:]], "gb_per_s": num_bytes / median / 1e9}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="Preset whose KV shape to use.")
    parser.add_argument("--tokens", default="512,2048,8192", help="Prompt lengths to send.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    arch, device = PRESETS[args.model], torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        by_variant = {v: measure(v, arch, num_tokens, device, dtype, args.repeats)
                      for v in VARIANTS}
        speedup = by_variant["per_block"]["median_ms"] / by_variant["block_free"]["median_ms"]
        for row in by_variant.values():
            row["block_free_speedup"] = speedup
            rows.append(row)
        print(f"{num_tokens:>6} tokens {by_variant['block_free']['num_bytes'] / 2**20:8.1f} MiB"
              f"  block-free {by_variant['block_free']['median_ms']:8.1f} ms"
              f"  per-block {by_variant['per_block']['median_ms']:8.1f} ms"
              f" ({by_variant['per_block']['messages']} messages)  x{speedup:.2f}", flush=True)
    result = {**result_header({"model": args.model, "device": args.device,
                               "dtype": args.dtype, "block_size": BLOCK_SIZE,
                               "repeats": args.repeats, "link": "TCP loopback, one host"}),
              "rows": rows}
    if device.type == "cuda":
        result["device"]["cuda"] = torch.cuda.get_device_name()
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
