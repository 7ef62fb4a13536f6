"""The sampler's cost per step: building the batch's settings (host) plus ``sample`` (device).

Each case is one setting for every row of a batch of requests with ``--prompt-tokens`` prompt
and ``--output-tokens`` generated tokens (the penalties count them), on the logits of a model
preset's vocabulary. A step is timed from building ``SamplingBatch.from_requests`` (which
copies the penalty counts' indices to the device) to the sampled tokens being ready (a
device sync on CUDA). ``top_k_top_p_sort`` forces the full-vocabulary sort on the same
setting as ``top_k_top_p`` to show what the top-k-first path saves.

    python benchmarks/bench_sampler.py --model codellama-34b --batch 1,64 --device cuda \\
        --out benchmarks/results/sampler_h200_codellama34b.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

# Runnable from a plain checkout: the package sits one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.engine.sampler import SamplingBatch, sample  # noqa: E402
from pdserve.model.arch import PRESETS  # noqa: E402
from pdserve.request import Request  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402

NUCLEUS = {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
CASES = {
    "greedy": {"temperature": 0.0},
    "top_k_top_p": NUCLEUS,
    "top_k_top_p_sort": NUCLEUS,
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "greedy_penalties": {"temperature": 0.0, **PENALTIES},
    "top_k_top_p_penalties": {**NUCLEUS, **PENALTIES},
    "top_k_top_p_penalties_logprobs": {**NUCLEUS, **PENALTIES, "logprobs": True,
                                       "top_logprobs": 20},
}


def make_requests(batch: int, args, params: SamplingParams, vocab: int) -> list[Request]:
    generator = torch.Generator().manual_seed(batch)
    requests = []
    for i in range(batch):
        ids = torch.randint(0, vocab, (args.prompt_tokens + args.output_tokens,),
                            generator=generator).tolist()
        request = Request(f"r{i}", ids[:args.prompt_tokens], params)
        request.token_ids = ids
        requests.append(request)
    return requests


def time_case(name: str, batch: int, args, vocab: int, device: torch.device) -> dict:
    params = SamplingParams(max_tokens=args.output_tokens + 1, **CASES[name])
    requests = make_requests(batch, args, params, vocab)
    logits = torch.randn(batch, vocab, device=device)
    times = []
    for step in range(args.warmup + args.iters):
        start = time.perf_counter()
        sampling = SamplingBatch.from_requests(requests, vocab, device)
        if name.endswith("_sort"):
            sampling.top_k_width = None
        tokens, _ = sample(logits, sampling)
        tokens.cpu()  # the engine's copy to pinned memory, waited for here
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"case": name, "batch": batch, "median_ms": statistics.median(times),
            "p90_ms": statistics.quantiles(times, n=10)[-1], "iters": args.iters}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="codellama-34b", choices=sorted(PRESETS))
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    vocab = PRESETS[args.model].vocab_size
    rows = [time_case(name, int(batch), args, vocab, device)
            for batch in args.batch.split(",") for name in args.cases.split(",")]
    for row in rows:
        print(f"{args.device} batch {row['batch']:>3} {row['case']:<32} "
              f"median {row['median_ms']:8.3f} ms  p90 {row['p90_ms']:8.3f} ms")
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        write_json({**result_header(config), "vocab_size": vocab, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
