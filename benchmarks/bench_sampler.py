"""The sampler's cost per step: building the batch's settings (host) plus ``sample`` (device).

Each case is one setting for every row of a batch of requests with ``--prompt-tokens`` prompt
and ``--output-tokens`` generated tokens (the penalties count them), on the logits of a model
preset's vocabulary. A step is timed from building ``SamplingBatch.from_requests`` (which
copies the penalty counts' indices to the device) to the sampled tokens being ready (a
device sync on CUDA). ``top_k_top_p_sort`` forces the full-vocabulary sort on the same
setting as ``top_k_top_p`` to show what the top-k-first path saves.

``greedy_grammar_json``: greedy with every row under a JSON schema's grammar (llguidance):
the step adds filling the rows' token bitmask on the host (here after the logits are made,
as the engine does once the forward is queued), its copy and its application, and advancing
each row's matcher past its token. Compare it with ``greedy``. A matcher that completes its
JSON is replaced by a fresh one (untimed), so every timed step is inside the grammar. The
token table is ``--tokenizer``'s (a Hugging Face folder with tokenizer.json, e.g. the
model's own) or, without one, a synthetic table of the preset's size: 256 bytes plus word
pieces (letters, with and without a leading space); the JSON records which.

    python benchmarks/bench_sampler.py --model codellama-34b --batch 1,64 --device cuda \\
        --out benchmarks/results/sampler_h200_codellama34b.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import string
import sys
import time
from pathlib import Path

import torch

# Runnable from a plain checkout: the package sits one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.engine.sampler import SamplingBatch, sample  # noqa: E402
from pdserve.model.arch import PRESETS  # noqa: E402
from pdserve.model.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from pdserve.request import Request  # noqa: E402
from pdserve.sampling_params import GrammarSpec, InvalidRequestError, SamplingParams  # noqa: E402
from pdserve.structured.grammars import GrammarCompiler, import_llguidance  # noqa: E402

NUCLEUS = {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
CASES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},  # a plain draw: what bench_engine.py's requests ask
    "top_k_top_p": NUCLEUS,
    "top_k_top_p_sort": NUCLEUS,
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "greedy_penalties": {"temperature": 0.0, **PENALTIES},
    "top_k_top_p_penalties": {**NUCLEUS, **PENALTIES},
    "top_k_top_p_penalties_logprobs": {**NUCLEUS, **PENALTIES, "logprobs": True,
                                       "top_logprobs": 20},
    "greedy_grammar_json": {"temperature": 0.0},
}
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["id", "name", "email", "score", "tags", "address"],
          "properties": {
              "id": {"type": "integer", "minimum": 0},
              "name": {"type": "string", "maxLength": 40},
              "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
              "score": {"type": "number"},
              "active": {"type": "boolean"},
              "tags": {"type": "array", "maxItems": 5,
                       "items": {"enum": ["new", "vip", "trial", "churned"]}},
              "address": {"type": "object", "required": ["city", "zip"],
                          "properties": {"city": {"type": "string"},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
GRAMMAR = GrammarSpec("json", json.dumps(SCHEMA), "bench")


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


def time_case(name: str, batch: int, args, vocab: int, device: torch.device,
              compiler: GrammarCompiler) -> dict:
    params = SamplingParams(max_tokens=args.output_tokens + 1, **CASES[name])
    requests = make_requests(batch, args, params, vocab)
    grammar = name.endswith("_grammar_json")
    logits = torch.randn(batch, vocab, device=device)
    times = []
    for step in range(args.warmup + args.iters):
        if grammar:
            _restart_finished(requests, compiler)
        start = time.perf_counter()
        sampling = SamplingBatch.from_requests(requests, vocab, device)
        if name.endswith("_sort"):
            sampling.top_k_width = None
        if sampling.grammar is not None:
            sampling.grammar.fill()
        tokens, _ = sample(logits, sampling)
        tokens = tokens.tolist()  # the engine's copy to pinned memory, waited for here
        if grammar:
            for request, token in zip(requests, tokens, strict=True):
                request.grammar.accept(token, token in request.eos_token_ids)
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"case": name, "batch": batch, "median_ms": statistics.median(times),
            "p90_ms": statistics.quantiles(times, n=10)[-1], "iters": args.iters}


def _restart_finished(requests: list[Request], compiler: GrammarCompiler) -> None:
    for request in requests:
        if request.grammar is None or request.grammar.raw.is_stopped():
            request.grammar = compiler.matcher(GRAMMAR)


def grammar_compiler(args, vocab: int) -> tuple[GrammarCompiler, str]:
    """The token table the grammar case uses, and how to describe it in the results."""
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
        if isinstance(tokenizer, ByteTokenizer):
            raise SystemExit(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
        return GrammarCompiler(tokenizer, vocab), f"tokenizer.json of {args.tokenizer}"
    return _WordPieceCompiler(vocab), "synthetic word pieces"


class _WordPieceCompiler(GrammarCompiler):
    """Bytes, BOS, EOS, then letter pieces of 1-3 characters with and without a leading
    space, until the vocabulary is full: a stand-in for a BPE table when none is given."""

    def __init__(self, vocab: int) -> None:
        super().__init__(ByteTokenizer(), vocab)

    def token_table(self, llg):
        pieces = (" " * space + "".join(letters) for size in (1, 2, 3)
                  for letters in itertools.product(string.ascii_lowercase, repeat=size)
                  for space in (1, 0))
        table = _Table()
        table.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"] + [
            p.encode() for p in itertools.islice(pieces, self.vocab_size - 258)]
        return llg.LLTokenizer(llg.TokenizerWrapper(table), n_vocab=len(table.tokens),
                               eos_token=ByteTokenizer.EOS)


class _Table:
    """What ``llguidance.TokenizerWrapper`` reads; text encodes byte by byte."""

    eos_token_id, bos_token_id = ByteTokenizer.EOS, ByteTokenizer.BOS
    special_token_ids = [ByteTokenizer.BOS, ByteTokenizer.EOS]
    tokens: list[bytes]

    def __call__(self, text) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


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
    parser.add_argument("--tokenizer", help="folder with the model's tokenizer.json, for the "
                        "grammar case's token table (default: synthetic word pieces)")
    parser.add_argument("--out")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    vocab = PRESETS[args.model].vocab_size
    if any(name.endswith("_grammar_json") for name in args.cases.split(",")):
        try:
            import_llguidance("--cases greedy_grammar_json")
        except InvalidRequestError as exc:
            raise SystemExit(str(exc)) from None
    compiler, token_table = grammar_compiler(args, vocab)
    rows = [time_case(name, int(batch), args, vocab, device, compiler)
            for batch in args.batch.split(",") for name in args.cases.split(",")]
    for row in rows:
        print(f"{args.device} batch {row['batch']:>3} {row['case']:<32} "
              f"median {row['median_ms']:8.3f} ms  p90 {row['p90_ms']:8.3f} ms")
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        write_json({**result_header(config), "vocab_size": vocab, "grammar_schema": SCHEMA,
                    "grammar_token_table": token_table, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
