"""Benchmark workloads: lists of requests with exact prompt token ids, reproducible from a seed.

Prompts are token-id lists, never text, so the prompt length the server sees is exactly the
length we asked for (no tokenizer round trip), and outputs are fixed with ``ignore_eos``.

Shapes (without a ``path``, ShareGPT and LooGLE lengths are synthesised; token *content*
is random, which is all a dummy-weight performance run needs; a ShareGPT file is read by
``pdserve.bench.sharegpt``):

- ``random``: prompt and output lengths uniform in ``[len * (1 - r), len * (1 + r)]``
  (``r`` = range ratio), the same convention as ``vllm bench serve --dataset-name random``.
- ``sharegpt`` without a file: chat. Prompt ~ lognormal(median 230, sigma 0.9) clipped to [8, 2048];
  output ~ lognormal(median 180, sigma 0.8) clipped to [8, 1024]. Means ~340 / ~250
  tokens: the shape of the ShareGPT_V3 conversations used by vLLM and SGLang benches
  (hundreds in, hundreds out, long right tail).
- ``loogle``: long-document QA. Prompt ~ lognormal(median 16K, sigma 0.3) clipped to
  [10K, 32K]; output ~ lognormal(median 32, sigma 0.6) clipped to [4, 128]. LooGLE's
  documents are ~10K-30K+ tokens with short answers; prefill dominates.
- ``mooncake``: replay of a Mooncake-format jsonl trace (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``), see :func:`mooncake_workload`.

``max_context`` clips every prompt so that prompt + output fits the server's context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class BenchError(ValueError):
    """A benchmark that cannot run as asked (unreachable server, unusable dataset file)."""


FIRST_TOKEN_ID = 10
"""Lowest token id used: keeps clear of BOS/EOS/padding ids that sit at the bottom of vocabs."""


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float | None = None
    """Offset from the start of the run (trace replay); None: the arrival process sets it."""
    meta: dict = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LengthShape:
    """A lognormal length distribution, clipped: ``median * exp(sigma * N(0, 1))``."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        values = self.median * np.exp(self.sigma * rng.standard_normal(n))
        return np.clip(np.round(values), self.low, self.high).astype(np.int64)


SHAPES: dict[str, tuple[LengthShape, LengthShape]] = {
    "sharegpt": (LengthShape(230, 0.9, 8, 2048), LengthShape(180, 0.8, 8, 1024)),
    "loogle": (LengthShape(16384, 0.3, 10240, 32768), LengthShape(32, 0.6, 4, 128)),
}


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, vocab_size, size=n).tolist()


def _clip_prompt(prompt_len: int, output_len: int, max_context: int | None) -> int:
    if max_context is None:
        return prompt_len
    return max(1, min(prompt_len, max_context - output_len))


def _build(prompt_lens, output_lens, seed: int, vocab_size: int,
           max_context: int | None) -> list[BenchRequest]:
    rng = np.random.default_rng([seed, 1])
    requests = []
    for prompt_len, output_len in zip(prompt_lens, output_lens, strict=True):
        length = _clip_prompt(int(prompt_len), int(output_len), max_context)
        requests.append(BenchRequest(random_tokens(rng, length, vocab_size), int(output_len)))
    return requests


def random_workload(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, vocab_size: int = 32000, max_context: int | None = None,
                    output_range_ratio: float | None = None) -> list[BenchRequest]:
    """``output_range_ratio`` (default: ``range_ratio``) spreads the outputs on their own,
    e.g. 0 for a fixed output length beside spread prompts."""
    rng = np.random.default_rng([seed, 0])

    def lengths(mean: int, ratio: float) -> np.ndarray:
        low = max(1, int(mean * (1 - ratio)))
        high = max(low, int(mean * (1 + ratio)))
        return rng.integers(low, high + 1, size=num)

    out_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    return _build(lengths(input_len, range_ratio), lengths(output_len, out_ratio), seed,
                  vocab_size, max_context)


def id_range(requests: list[BenchRequest], vocab_size: int) -> int:
    """Token ids of ``requests`` lie below this: ``vocab_size``, or more for prompts read
    through a real tokenizer."""
    return max([vocab_size] + [max(r.prompt_token_ids) + 1 for r in requests
                               if r.prompt_token_ids])


def salted(requests: list[BenchRequest], salt: int, vocab_size: int) -> list[BenchRequest]:
    """The same requests with every token id shifted by ``salt`` (mod the id range): a fresh
    prompt to a server's prefix cache, while prompts that shared a prefix still share it.
    Runs of one workload on one server (goodput probes) need this, else the second run's
    prefills are cache hits."""
    span = vocab_size - FIRST_TOKEN_ID
    if salt % span == 0:
        return requests
    return [BenchRequest([FIRST_TOKEN_ID + (t - FIRST_TOKEN_ID + salt) % span
                          for t in r.prompt_token_ids], r.output_len, r.arrival_s, r.meta)
            for r in requests]


def shaped_workload(name: str, num: int, seed: int = 0, vocab_size: int = 32000,
                    max_context: int | None = None) -> list[BenchRequest]:
    """ShareGPT-like (``sharegpt``) or LooGLE-like (``loogle``) lengths, see the module doc."""
    prompt_shape, output_shape = SHAPES[name]
    rng = np.random.default_rng([seed, 0])
    prompts = prompt_shape.sample(rng, num)
    outputs = output_shape.sample(rng, num)
    return _build(prompts, outputs, seed, vocab_size, max_context)


# --- Mooncake trace replay -------------------------------------------------------------------

def load_trace(path: str | Path, start_s: float = 0.0, duration_s: float | None = None,
               max_requests: int | None = None, spread: bool = False) -> list[dict]:
    """Trace rows in the window ``[start_s, start_s + duration_s)``, at most ``max_requests``:
    the first ones, or with ``spread`` evenly spaced over the whole window (its long-range
    shape kept, its short bursts thinned)."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            t = row["timestamp"] / 1000.0
            if t < start_s or (duration_s is not None and t >= start_s + duration_s):
                continue
            rows.append(row)
            if not spread and max_requests is not None and len(rows) >= max_requests:
                break
    if spread and max_requests is not None and len(rows) > max_requests:
        picks = np.linspace(0, len(rows) - 1, max_requests).round().astype(int)
        rows = [rows[i] for i in picks]
    return rows


class BlockTokens:
    """Maps a trace hash id to one fixed block of tokens, so equal ids share real tokens."""

    def __init__(self, block_size: int, seed: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.seed = seed
        self.vocab_size = vocab_size
        self._cache: dict[int, list[int]] = {}

    def __call__(self, hash_id: int) -> list[int]:
        block = self._cache.get(hash_id)
        if block is None:
            # Seeded by the id itself: the mapping does not depend on which rows were loaded.
            rng = np.random.default_rng([self.seed, 2, int(hash_id)])
            block = random_tokens(rng, self.block_size, self.vocab_size)
            self._cache[hash_id] = block
        return block


def trace_prompt(row: dict, blocks: BlockTokens, rng: np.random.Generator) -> list[int]:
    tokens: list[int] = []
    for hash_id in row["hash_ids"]:
        tokens.extend(blocks(hash_id))
    length = int(row["input_length"])
    if len(tokens) < length:
        # Rows longer than their hash blocks get unshared filler (never seen in Mooncake data).
        tokens.extend(random_tokens(rng, length - len(tokens), blocks.vocab_size))
    # The last hash block is partial: its id covers the first `length % block` tokens only.
    return tokens[:length]


def rescale_arrivals(times_s: list[float], rate: float | None = None,
                     time_scale: float = 1.0) -> list[float]:
    """Shifts the first arrival to 0, then either stretches to a mean ``rate`` or scales by
    ``time_scale`` (0.5 = twice as fast)."""
    if not times_s:
        return []
    base = times_s[0]
    shifted = [t - base for t in times_s]
    span = shifted[-1]
    if rate is not None and span > 0:
        # Mean rate over n requests: (n - 1) gaps fill the span.
        time_scale = (len(shifted) - 1) / rate / span
    return [t * time_scale for t in shifted]


def mooncake_workload(path: str | Path, seed: int = 0, vocab_size: int = 32000,
                      block_size: int = 512, start_s: float = 0.0,
                      duration_s: float | None = None, max_requests: int | None = None,
                      rate: float | None = None, time_scale: float = 1.0,
                      max_context: int | None = None,
                      spread: bool = False) -> list[BenchRequest]:
    """Requests of a Mooncake trace with the trace's own arrival times (optionally rescaled)."""
    if not Path(path).is_file():
        raise BenchError(f"Mooncake trace not found: {path}")
    rows = load_trace(path, start_s, duration_s, max_requests, spread)
    rows.sort(key=lambda r: r["timestamp"])
    blocks = BlockTokens(block_size, seed, vocab_size)
    rng = np.random.default_rng([seed, 3])
    arrivals = rescale_arrivals([r["timestamp"] / 1000.0 for r in rows], rate, time_scale)
    requests = []
    for row, arrival in zip(rows, arrivals, strict=True):
        output_len = int(row["output_length"])
        prompt = trace_prompt(row, blocks, rng)
        prompt = prompt[:_clip_prompt(len(prompt), output_len, max_context)]
        requests.append(BenchRequest(prompt, output_len, arrival,
                                     {"trace_timestamp_ms": row["timestamp"]}))
    return requests


def workload_stats(requests: list[BenchRequest]) -> dict:
    prompts = np.array([r.prompt_len for r in requests] or [0])
    outputs = np.array([r.output_len for r in requests] or [0])
    return {
        "num_requests": len(requests),
        "prompt_len_mean": float(prompts.mean()), "prompt_len_max": int(prompts.max()),
        "output_len_mean": float(outputs.mean()), "output_len_max": int(outputs.max()),
        "total_prompt_tokens": int(prompts.sum()), "total_output_tokens": int(outputs.sum()),
    }
