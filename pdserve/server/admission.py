"""Admission of offered prefills on a prefill instance (on-demand forwarding): whether a
new prompt would have its first token within the gateway's TTFT budget here.

Kept apart from the HTTP routes (``server/pd.py``) so that the fleet simulator
(``pdserve/sim``), which runs this same rule on simulated time, imports no web framework.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.server import protocol as P

RATE_SMOOTHING = 0.3  # weight of the newest prefill in the throughput estimate


class PrefillAdmission:
    """Predicts when a new prefill would have its first token: the prompt tokens in flight
    here plus its own, over the prefill throughput measured on recent requests (served
    first come, first served)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # the simulator (``pdserve/sim``) runs this on simulated time
        self.queued_tokens = 0
        self.tokens_per_s: float | None = None  # unknown until a prefill has finished
        self._last_done = 0.0
        self.accepted = 0
        self.rejected = 0

    def predicted_ttft_ms(self, num_tokens: int) -> float:
        """When a new prompt of ``num_tokens`` would have its first token: behind the
        prompts in flight here, then its own; 0 while the throughput is still unknown."""
        if not self.tokens_per_s:
            return 0.0
        return (self.queued_tokens + num_tokens) / self.tokens_per_s * 1e3

    def admit(self, num_tokens: int, ttft_budget_ms: float | None) -> None:
        """Counts the prefill in, or raises 429 if its first token would come too late
        because of the prompts ahead of it (``try_admit``)."""
        refused_ttft = self.try_admit(num_tokens, ttft_budget_ms)
        if refused_ttft is not None:
            raise P.APIError(429, f"this prefill instance would have the first token in about "
                             f"{refused_ttft:.0f} ms, past the {ttft_budget_ms:.0f} ms allowed",
                             code="prefill_busy")

    def try_admit(self, num_tokens: int, ttft_budget_ms: float | None) -> float | None:
        """Counts the prefill in and returns None, or returns the predicted TTFT (ms) that
        refuses it. An idle instance takes any prompt: if that one is too long for the
        budget, no instance could do better. (The fleet simulator offers millions of
        prompts: a refusal there must not cost an exception.)"""
        ttft = self.predicted_ttft_ms(num_tokens)
        if ttft_budget_ms is not None and self.queued_tokens and ttft > ttft_budget_ms:
            self.rejected += 1
            return ttft
        self.accepted += 1
        self.queued_tokens += num_tokens
        return None

    def done(self, num_tokens: int, num_computed: int | None, arrival: float) -> None:
        """A prefill left; ``num_computed`` of its tokens were computed (the rest were prefix
        hits) between its arrival or the previous prefill's end and now; None if it failed
        (no throughput sample)."""
        now = self.clock()
        self.queued_tokens -= num_tokens
        if num_computed is None:
            return
        service = now - max(arrival, self._last_done)
        self._last_done = now
        if service <= 0 or num_computed <= 0:
            return
        sample = num_computed / service
        old = self.tokens_per_s
        self.tokens_per_s = sample if old is None else old + RATE_SMOOTHING * (sample - old)
