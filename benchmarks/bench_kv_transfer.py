"""Block-free KV transfer against block-by-block, prefill pool to decode pool, per transport.

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

``--transports`` picks the links: ``tcp`` is the above (both ends in this process);
``p2p`` (torch.distributed: NCCL between GPUs, gloo between CPUs) and ``ipc`` (CUDA IPC)
run the sender in a second process, as between two instances (``transfer/links.py``): the
child builds the same seeded source pool, gathers and sends on each round's signal; the
clock here runs from that signal until the last page is scattered. NCCL refuses two ranks
on one GPU, so p2p on a GPU host needs two GPUs (``--peer-device cuda:1``); IPC between two
processes on one GPU is a real IPC path (the receiver maps the other process's memory).

    python benchmarks/bench_kv_transfer.py --model llama3-8b --tokens 512,2048,8192 \\
        --out benchmarks/results/kv_transfer_cpu.json
    python benchmarks/bench_kv_transfer.py --transports tcp,p2p --tokens 512,2048 \\
        --repeats 3                                  # on CPU, p2p is gloo: a sanity check
    python benchmarks/bench_kv_transfer.py --device cuda --transports tcp,ipc,p2p \\
        --peer-device cuda:1 --tokens 512,2048,8192    # IPC and NCCL between two GPUs
"""

from __future__ import annotations

import argparse
import multiprocessing
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
from pdserve.transfer.links import (  # noqa: E402
    KVSender,
    LinkServer,
    device_index,
    local_endpoint,
)
from pdserve.transfer.tcp import TcpKVReceiver, TcpKVSender  # noqa: E402

BLOCK_SIZE = 16


def make_pools(arch, num_tokens: int, device: torch.device, dtype: torch.dtype):
    """A source pool holding the request in shuffled pages, and an empty destination."""
    num_pages = -(-num_tokens // BLOCK_SIZE)
    pool_pages = 2 * num_pages + 8
    source = allocate_kv_pool(arch, pool_pages, BLOCK_SIZE, dtype, device)
    values = torch.Generator(device=device).manual_seed(num_tokens)  # same in a sender child
    for k, v in source:
        k.normal_(generator=values)
        v.normal_(generator=values)
    dest = allocate_kv_pool(arch, pool_pages, BLOCK_SIZE, dtype, device)
    generator = torch.Generator().manual_seed(num_tokens)
    pages = torch.randperm(pool_pages, generator=generator)
    return source, pages[:num_pages].tolist(), dest, pages[num_pages:2 * num_pages].tolist()


def block_free(source, src_pages, dest, dst_pages, num_tokens, sender, receiver) -> None:
    send_block_free(source, src_pages, num_tokens, sender, receiver.address)
    receive_block_free(dest, dst_pages, num_tokens, receiver)


def send_block_free(source, src_pages, num_tokens, sender, address) -> None:
    buffer = gather_blocks(source, src_pages, num_tokens)
    sender.send(address, "whole", buffer)  # a device buffer is staged by the sender


def receive_block_free(dest, dst_pages, num_tokens, receiver) -> None:
    scatter_blocks(receiver.recv("whole", timeout=120), dest, dst_pages)


def per_block(source, src_pages, dest, dst_pages, num_tokens, sender, receiver) -> None:
    consumer = threading.Thread(target=receive_per_block,
                                args=(dest, dst_pages, num_tokens, receiver))
    consumer.start()
    send_per_block(source, src_pages, num_tokens, sender, receiver.address)
    consumer.join()


def _page_messages(num_layers: int, num_pages: int) -> list[tuple[int, int]]:
    return [(layer, i) for layer in range(num_layers) for i in range(num_pages)]


def send_per_block(source, src_pages, num_tokens, sender, address) -> None:
    for layer, i in _page_messages(len(source), len(src_pages)):
        rows = min(BLOCK_SIZE, num_tokens - i * BLOCK_SIZE)
        k, v = source[layer]
        page = torch.stack((k[src_pages[i], :rows], v[src_pages[i], :rows]))[None]
        sender.send(address, f"{layer}/{i}", page)


def receive_per_block(dest, dst_pages, num_tokens, receiver) -> None:
    for layer, i in _page_messages(len(dest), len(dst_pages)):
        page = receiver.recv(f"{layer}/{i}", timeout=120)[0].to(dest[0][0].device)
        rows = page.shape[1]
        k, v = dest[layer]
        k[dst_pages[i], :rows] = page[0]
        v[dst_pages[i], :rows] = page[1]


VARIANTS = {"block_free": block_free, "per_block": per_block}
SENDS = {"block_free": send_block_free, "per_block": send_per_block}
RECEIVES = {"block_free": receive_block_free, "per_block": receive_per_block}


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
    return _row(variant, arch, num_tokens, len(src_pages), dtype, times)


def measure_across(variant, transport, args, num_tokens) -> dict:
    """The sender in a child process on ``--peer-device``, linked by ``transport``."""
    arch, device, dtype = PRESETS[args.model], torch.device(args.device), getattr(torch,
                                                                                   args.dtype)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    endpoint = local_endpoint(transport, device)
    with TcpKVReceiver(links=LinkServer(endpoint)) as receiver:
        source, src_pages, dest, dst_pages = make_pools(arch, num_tokens, device, dtype)
        child = context.Process(target=sender_child, args=(
            theirs, transport, receiver.address, args, num_tokens, variant, args.repeats + 1))
        child.start()
        times = [_receive_round(ours, variant, dest, dst_pages, num_tokens, receiver, device)
                 for _ in range(args.repeats + 1)]
        chosen = ours.recv()
        child.join()
        if not same_kv(source, src_pages, dest, dst_pages, num_tokens):
            raise AssertionError(f"{variant} over {transport}: received KV differs")
    if chosen != transport:
        raise AssertionError(f"asked for {transport}, the link was {chosen}")
    return _row(variant, arch, num_tokens, len(src_pages), dtype, times)


def _receive_round(pipe, variant, dest, dst_pages, num_tokens, receiver, device) -> float:
    for k, v in dest:  # a round that delivered nothing must not pass on the last one's KV
        k.zero_()
        v.zero_()
    _sync(device)
    start = time.perf_counter()
    pipe.send("go")
    RECEIVES[variant](dest, dst_pages, num_tokens, receiver)
    _sync(device)
    return time.perf_counter() - start


def sender_child(pipe, transport, address, args, num_tokens, variant, rounds) -> None:
    """Builds the same seeded source pool, then sends it once per signal."""
    device = torch.device(args.peer_device or args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device_index(device))
    source, src_pages, _, _ = make_pools(PRESETS[args.model], num_tokens, device,
                                         getattr(torch, args.dtype))
    sender = KVSender(local_endpoint(transport, device))
    for _ in range(rounds):
        pipe.recv()
        SENDS[variant](source, src_pages, num_tokens, sender, address)
    pipe.send(sender.chosen.get(address))
    sender.close()


def _row(variant, arch, num_tokens, num_pages, dtype, times) -> dict:
    num_bytes = 2 * arch.num_layers * num_tokens * arch.num_kv_heads * arch.head_dim
    num_bytes *= dtype.itemsize
    median = statistics.median(times[1:])  # the first round sets the link up
    messages = 1 if variant == "block_free" else arch.num_layers * num_pages
    return {"variant": variant, "num_tokens": num_tokens, "num_bytes": num_bytes,
            "messages": messages, "median_ms": median * 1e3,
            "all_ms": [t * 1e3 for t in times[1:]], "gb_per_s": num_bytes / median / 1e9}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_pair(transport: str, args, num_tokens: int) -> list[dict]:
    """Both variants over one transport; prints a line, returns the rows."""
    if transport == "tcp":
        arch, device = PRESETS[args.model], torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        by_variant = {v: measure(v, arch, num_tokens, device, dtype, args.repeats)
                      for v in VARIANTS}
    else:
        by_variant = {v: measure_across(v, transport, args, num_tokens) for v in VARIANTS}
    free, paged = by_variant["block_free"], by_variant["per_block"]
    speedup = paged["median_ms"] / free["median_ms"]
    for row in by_variant.values():
        row.update(transport=transport, block_free_speedup=speedup)
    print(f"{transport:>4} {num_tokens:>6} tokens {free['num_bytes'] / 2**20:8.1f} MiB"
          f"  block-free {free['median_ms']:8.1f} ms ({free['gb_per_s']:.2f} GB/s)"
          f"  per-block {paged['median_ms']:8.1f} ms ({paged['messages']} messages)"
          f"  x{speedup:.2f}", flush=True)
    return list(by_variant.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="Preset whose KV shape to use.")
    parser.add_argument("--tokens", default="512,2048,8192", help="Prompt lengths to send.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--transports", default="tcp", help="Comma-separated: tcp (both "
                        "ends here), p2p, ipc (the sender in a second process).")
    parser.add_argument("--peer-device", default=None, help="The sender process's device "
                        "for p2p / ipc (default: --device).")
    args = parser.parse_args()
    rows = []
    for transport in args.transports.split(","):
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            rows += measure_pair(transport, args, num_tokens)
    result = {**result_header({"model": args.model, "device": args.device,
                               "peer_device": args.peer_device or args.device,
                               "dtype": args.dtype, "block_size": BLOCK_SIZE,
                               "repeats": args.repeats, "transports": args.transports,
                               "link": "one host: TCP loopback, gloo/NCCL, CUDA IPC"}),
              "rows": rows}
    if torch.device(args.device).type == "cuda":
        result["device"]["cuda"] = torch.cuda.get_device_name()
    if args.out:
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
