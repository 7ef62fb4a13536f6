"""Beam search (``use_beam_search``), as vLLM serves it: in the server, over the engine.

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

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

MAX_WIDTH = 10
"""Widest beam: each step asks for ``2 x width`` alternatives, and logprobs go to 20."""

# The fields a beam search cannot honour, with the values that leave them off: it samples
# nothing (no temperature, seed or filters), stops only at end of sequence or max_tokens,
# and returns no logprobs.
CONFLICTS: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "temperature": (0,), "top_p": (1,), "top_k": (-1, 0), "min_p": (0,),
    "seed": (), "stop": ([], ""), "stop_token_ids": ([],), "min_tokens": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],), "logprobs": (False,),
    "top_logprobs": (0,), "prompt_logprobs": (), "response_format": ({"type": "text"},),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (),
}


def conflicting_field(body: dict[str, Any]) -> str | None:
    """The first field of ``body`` a beam search cannot honour, at a value that asks for
    it; None when there is none."""
    for name, off in CONFLICTS.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in off):
            return name
    return None


def _same(value: Any, off: Any) -> bool:
    if isinstance(value, bool) or isinstance(off, bool):  # completions' logprobs: 0 is on
        return value is off
    return value == off


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    """The sum of its tokens' logprobs."""
    finished: bool = False
    """It ended with an end-of-sequence token."""


NextTokens = Callable[[list[int]], Awaitable[list[tuple[int, float]]]]
"""A beam's tokens -> the most likely next tokens and their logprobs, best first."""


async def beam_search(next_tokens: NextTokens, width: int, max_tokens: int,
                      eos_token_ids: set[int], ignore_eos: bool, length_penalty: float,
                      prompt_len: int) -> list[Beam]:
    """The ``width`` best beams, best first (see the module doc)."""
    live, finished = [Beam()], []
    for _ in range(max_tokens):
        tops = await asyncio.gather(*(next_tokens(beam.tokens) for beam in live))
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
