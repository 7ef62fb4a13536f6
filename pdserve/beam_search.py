"""Beam search, as vLLM runs it: over the engine, a step per token (the server's
``use_beam_search`` and the offline ``LLM.beam_search``).

Each step asks the engine for one more token of every live beam (a request of the prompt
plus the beam's tokens, ``max_tokens`` 1, the ``2 x width`` most likely tokens under the
model's raw distribution; the prefix cache holds the shared prefix, so each computes about
one token). Every candidate that ends with an end-of-sequence token is put aside as
finished; of the rest the ``width`` with the highest summed logprob go on. After
``max_tokens`` steps (or when none is live) the finished beams and the live ones are
ranked by summed logprob over ``length ** length_penalty`` (the length counts the prompt,
as vLLM's does) and the best ``n`` answer.

A beam search costs one engine round trip per token: it is for offline-style requests
(evaluation, translation), not for latency.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

MAX_WIDTH = 10
"""Widest beam: each step asks for ``2 x width`` alternatives, and logprobs go to 20."""


@dataclass(frozen=True)
class BeamSearchParams:
    """The offline ``LLM.beam_search``'s settings, as vLLM's."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_WIDTH:
            raise ValueError(f"beam_width must be 1..{MAX_WIDTH}, not {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    """The sum of its tokens' logprobs."""
    finished: bool = False
    """It ended with an end-of-sequence token."""


NextTokens = Callable[[list[list[int]]], Awaitable[list[list[tuple[int, float]]]]]
"""Each live beam's tokens -> its most likely next tokens and their logprobs, best first
(one step of every beam: the server runs them at once, the offline ``LLM`` as one batch)."""


async def beam_search(next_tokens: NextTokens, width: int, max_tokens: int,
                      eos_token_ids: set[int], ignore_eos: bool, length_penalty: float,
                      prompt_len: int) -> list[Beam]:
    """The ``width`` best beams, best first (see the module doc)."""
    live, finished = [Beam()], []
    for _ in range(max_tokens):
        tops = await next_tokens([beam.tokens for beam in live])
        candidates = [Beam(beam.tokens + [token], beam.logprob + logprob)
                      for beam, top in zip(live, tops, strict=True) for token, logprob in top]
        ended = [c for c in candidates if not ignore_eos and c.tokens[-1] in eos_token_ids]
        for beam in ended:
            beam.finished = True
        finished += ended
        going = [c for c in candidates if not c.finished]
        live = sorted(going, key=lambda b: b.logprob, reverse=True)[:width]
        if not live:
            break
    ranked = sorted(finished + live, reverse=True,
                    key=lambda b: _score(b, prompt_len, length_penalty))
    return ranked[:width]


def _score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    # vLLM's: the end-of-sequence token does not count in the length.
    length = prompt_len + len(beam.tokens) - (1 if beam.finished else 0)
    return beam.logprob / max(length, 1) ** length_penalty
