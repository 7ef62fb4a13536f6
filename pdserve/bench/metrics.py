"""Per-request timing records and the summary users of vLLM / SGLang benches expect.

Definitions (all latencies from the moment the request was sent):

- TTFT: until the first streamed chunk that carries at least one token.
- ITL: every gap between two consecutive token-carrying chunks, per token: a later chunk
  with k tokens, ``gap`` after the previous one, gives k samples of ``gap / k`` (so every
  token after the first chunk has one sample; SGLang's bench splits the same way). The
  extra tokens of the *first* chunk give none: their gaps lie inside TTFT, unobservable.
  Samples per request = output tokens - tokens of the first chunk.
- TPOT: per request, ``(E2E - TTFT) / (output tokens - 1)``; requests with one token have none.
- E2E: until the stream closed.
- SLO attainment: share of *all* sent requests (failures count as misses) with
  TTFT <= TTFT SLO and TPOT <= ITL SLO (DistServe's definition); the P99 of all ITL
  gaps is reported beside it because a TPOT mean hides stalls.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
MAX_ERRORS_KEPT = 5
APPROXIMATE_SOURCE = "text"
"""Token counts taken as one per chunk with text: exact only when no chunk merges tokens."""


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int
    """Tokens asked for."""
    send_time: float
    """Absolute ``time.perf_counter()`` seconds."""
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_time: float | None = None
    output_tokens: int | None = None
    """Tokens generated as the server counted them (usage); defaults to the streamed count."""
    success: bool = False
    error: str = ""
    count_source: str = ""
    """Where the per-chunk token counts came from (``usage``, ``logprobs``, ``num_tokens``,
    ``token_ids``, ``engine``, or ``text``: approximate)."""

    def add_chunk(self, t: float, num_tokens: int = 1, source: str = "") -> None:
        """A chunk of ``num_tokens`` (> 0) received at ``t``, counted from ``source``."""
        self.chunk_times.append(t)
        self.chunk_tokens.append(num_tokens)
        if self.count_source != APPROXIMATE_SOURCE:  # one guessed chunk makes the whole guessed
            self.count_source = source

    @property
    def num_output_tokens(self) -> int:
        if self.output_tokens is not None:
            return self.output_tokens
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        gaps = []
        for i in range(1, len(self.chunk_times)):
            gap = self.chunk_times[i] - self.chunk_times[i - 1]
            count = max(1, self.chunk_tokens[i])
            gaps.extend([gap / count] * count)
        return gaps

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        if not self.success or n < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def meets_slo(self, ttft_slo_s: float | None, itl_slo_s: float | None) -> bool:
        return meets_slo(self.success, self.ttft, self.tpot, ttft_slo_s, itl_slo_s)


def meets_slo(success: bool, ttft: float | None, tpot: float | None,
              ttft_slo: float | None, tpot_slo: float | None) -> bool:
    """DistServe's rule, in any one unit: a failure or a request without a token misses; a
    request with one token has no TPOT and is judged on TTFT alone."""
    if not success or ttft is None:
        return False
    if ttft_slo is not None and ttft > ttft_slo:
        return False
    return tpot_slo is None or tpot is None or tpot <= tpot_slo


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean / std / min / max / p50 / p90 / p99 in milliseconds (None when empty)."""
    keys = ["mean", "std", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": ms.mean(), "std": ms.std(), "min": ms.min(), "max": ms.max()}
    for p in PERCENTILES:
        out[f"p{p}"] = np.percentile(ms, p)
    return {k: float(out[k]) for k in keys}


def slo_attainment(records: list[RequestRecord], ttft_slo_ms: float | None,
                   itl_slo_ms: float | None) -> float | None:
    if not records or (ttft_slo_ms is None and itl_slo_ms is None):
        return None
    ttft_s = None if ttft_slo_ms is None else ttft_slo_ms / 1000.0
    itl_s = None if itl_slo_ms is None else itl_slo_ms / 1000.0
    return sum(r.meets_slo(ttft_s, itl_s) for r in records) / len(records)


def sample_attainment(samples: list[dict], ttft_slo_ms: float | None,
                      tpot_slo_ms: float | None) -> float | None:
    """:func:`slo_attainment` of saved per-request samples (``request_samples``), so one run
    answers for every SLO pair after the fact."""
    if not samples:
        return None
    met = sum(meets_slo(s["success"], s["ttft_ms"], s["tpot_ms"], ttft_slo_ms, tpot_slo_ms)
              for s in samples)
    return met / len(samples)


def distinct_errors(records: list[RequestRecord]) -> list[dict]:
    """The first few distinct error messages, each with how many requests it ended."""
    counts = Counter(r.error or "no token received" for r in records if not r.success)
    return [{"error": e, "count": n} for e, n in list(counts.items())[:MAX_ERRORS_KEPT]]


def token_count_quality(records: list[RequestRecord]) -> dict:
    """How the streamed token counts were obtained; ``exact`` is False when any request's
    counts were guessed from text chunks (its TTFT and ITL may then be off)."""
    sources = Counter(r.count_source or APPROXIMATE_SOURCE for r in records if r.chunk_times)
    return {"exact": APPROXIMATE_SOURCE not in sources, "sources": dict(sources)}


def summarize(records: list[RequestRecord], duration_s: float,
              ttft_slo_ms: float | None = None, itl_slo_ms: float | None = None) -> dict:
    """The run's metrics; top-level keys follow ``vllm bench serve`` where one exists."""
    done = [r for r in records if r.success]
    output_tokens = sum(r.num_output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    duration_s = max(duration_s, 1e-9)
    attainment = slo_attainment(records, ttft_slo_ms, itl_slo_ms)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": distinct_errors(records),
        "token_counts": token_count_quality(records),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": stats_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itls]),
        "tpot_ms": stats_ms([r.tpot for r in done if r.tpot is not None]),
        "e2e_ms": stats_ms([r.e2e for r in done if r.e2e is not None]),
        "slo": {"ttft_ms": ttft_slo_ms, "itl_ms": itl_slo_ms},
        "slo_attainment": attainment,
        # Requests meeting the SLO per second of this run (vLLM's "request goodput").
        "slo_request_throughput": None if attainment is None
        else attainment * len(records) / duration_s,
    }


def chunk_token_runs(tokens: list[int]) -> list[list[int]]:
    """Tokens per streamed chunk as ``[tokens, chunks in a row]`` runs. Answers stream one
    token a chunk but for a few, so a run's records keep every count at a small fraction
    of the plain list's size (which made up three quarters of a probe's record)."""
    runs: list[list[int]] = []
    for count in tokens:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return runs


def chunk_tokens_of(sample: dict) -> list[int]:
    """A sample's tokens per chunk, from its runs (``chunk_token_runs``) or from the plain
    list (``chunk_tokens``) that records written before the runs hold."""
    if "chunk_token_runs" in sample:
        return [count for count, chunks in sample["chunk_token_runs"] for _ in range(chunks)]
    return list(sample.get("chunk_tokens") or [])


def request_samples(records: list[RequestRecord], t0: float) -> list[dict]:
    """Per-request samples for the JSON result, times relative to the run start ``t0``."""
    out = []
    for r in records:
        out.append({
            "prompt_len": r.prompt_len, "output_len": r.output_len,
            "output_tokens": r.num_output_tokens, "success": r.success, "error": r.error,
            "chunk_token_runs": chunk_token_runs(r.chunk_tokens), "count_source": r.count_source,
            "send_s": round(r.send_time - t0, 6),
            "ttft_ms": _ms(r.ttft), "tpot_ms": _ms(r.tpot), "e2e_ms": _ms(r.e2e),
            "itl_ms": [round(g * 1000.0, 3) for g in r.itls],
        })
    return out


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1000.0, 3)
