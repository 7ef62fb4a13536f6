"""A request, tracked by token counters rather than a phase flag.

``num_computed`` counts tokens whose KV is in the cache; ``num_tokens`` counts prompt and
output tokens. Prefill, a chunk of it, a prefix-cache hit, recompute after preemption and KV
received from another instance all reduce to "advance num_computed towards num_tokens".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from pdserve.handoff import HANDOFF_FINISH_REASON, KVHandoff
from pdserve.sampling_params import PromptLogprob, SamplingParams

if TYPE_CHECKING:
    from pdserve.structured.grammars import Matcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    num_scoring: ClassVar[int] = 0
    """Requests of this process still to score their prompt: while none is, a step spends
    nothing on prompt logprobs, not even a pass over its batch."""
    num_embedding: ClassVar[int] = 0
    """Requests of this process whose embedding is still to be taken: as ``num_scoring``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)

    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    # Hash of each full block of token_ids, filled lazily by the block manager.
    block_hashes: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    handoff: KVHandoff | None = None  # P/D across instances (see pdserve/handoff.py)
    kv_buffer: torch.Tensor | None = None  # decode side: received KV not yet scattered
    deadline: float = 0.0  # decode side: fail if the KV has not arrived by then
    distinct_prompt_ids: np.ndarray | None = None  # for the repetition penalty, made once
    # Overlap scheduling: tokens sampled by launches still running, not yet in ``token_ids``
    # (counted in ``num_tokens``), and the row of the newest one in its lane's device buffer.
    num_placeholders: int = 0
    placeholder_row: int = 0
    grammar: Matcher | None = None  # structured output: where the output is in its grammar
    bad_words: tuple[tuple[int, ...], ...] = ()  # ``params.bad_words`` as token ids
    _allowed: tuple[list[int], np.ndarray] | None = None  # ``allowed_ids``, made once
    # Prompt logprobs asked for and not yet sent: one entry per prompt position, filled as
    # the prefill steps score them (None: the first token, or not scored yet).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # ``params.return_embedding``: True until the step of its first token takes its
    # embedding (``claim_embedding``); the embedding, once stored, until sent.
    embedding_pending: bool = False
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            Request.num_scoring += 1
        if self.params.return_embedding:
            self.embedding_pending = True
            Request.num_embedding += 1

    def claim_embedding(self) -> bool:
        """True once: for the step that samples its first token (its last prompt token's
        row is the embedding), and for no later one. The engine also calls it when it
        forgets a request, so an aborted one stops counting in ``num_embedding``."""
        pending, self.embedding_pending = self.embedding_pending, False
        Request.num_embedding -= pending
        return pending

    def take_embedding(self) -> list[float] | None:
        """The stored embedding, once: it goes out with the first token."""
        embedding, self.embedding = self.embedding, None
        return embedding

    @property
    def scores_prompt(self) -> bool:
        """Its prompt logprobs are still to be computed (and it must skip the prefix cache)."""
        return self.prompt_logprobs is not None

    def take_prompt_logprobs(self) -> list[PromptLogprob | None] | None:
        """The prompt logprobs, once: they go out with the first token (a recompute after
        preemption does not score the prompt again). The engine also calls it when it
        forgets a request, so an aborted one stops counting in ``num_scoring``."""
        scored, self.prompt_logprobs = self.prompt_logprobs, None
        Request.num_scoring -= scored is not None
        return scored

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those still being sampled included."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def allowed_ids(self) -> np.ndarray | None:
        """``params.allowed_token_ids`` as an array, converted once: a list of most of a
        large vocabulary costs milliseconds to convert, every step otherwise."""
        allowed = self.params.allowed_token_ids
        if allowed is None:
            return None
        if self._allowed is None or self._allowed[0] is not allowed:
            self._allowed = (allowed, np.asarray(allowed, dtype=np.int64))
        return self._allowed[1]

    @property
    def bad_words_follow_output(self) -> bool:
        """A bad word of several tokens: which token it refuses depends on the last ones."""
        return any(len(word) > 1 for word in self.bad_words)

    def refused_by_bad_words(self) -> set[int]:
        """The tokens a bad word refuses next: the last of each word whose other tokens end
        the output (a one-token word: always)."""
        longest = max(map(len, self.bad_words), default=1)
        # only the output's last tokens can start a word: no copy of the whole output a step
        output = self.token_ids[max(self.num_prompt_tokens, len(self.token_ids) - longest + 1):]
        return {word[-1] for word in self.bad_words
                if len(word) - 1 <= len(output)
                and tuple(output[len(output) - len(word) + 1:]) == word[:-1]}

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.grammar is not None:
            self.grammar.accept(token_id, token_id in self.eos_token_ids)

    def ends_at_pending_tokens(self, max_model_len: int) -> bool:
        """The tokens still being sampled bring it to a length limit or a hand-off, so it
        finishes when they arrive whatever they are (``check_stop`` will say so then)."""
        num_tokens = self.num_tokens
        return (num_tokens - len(self.prompt_token_ids) >= self.params.max_tokens
                or num_tokens >= max_model_len
                or (self.handoff is not None and self.handoff.is_prefill))

    def check_stop(self, max_model_len: int) -> str | None:
        """Finish reason after the last appended token, or None to continue."""
        # Runs for every running request every step: plain reads, no property calls.
        params, token_ids = self.params, self.token_ids
        num_tokens = len(token_ids)
        num_output_tokens = num_tokens - len(self.prompt_token_ids)
        if self.grammar is not None and self.grammar.consumed_eos:
            return "stop"  # the grammar is complete: EOS was the only token it allowed
        if self.grammar is not None and self.grammar.failed:
            return "error"
        if num_output_tokens >= params.min_tokens:
            last = token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                return "stop"
            if last in params.stop_token_ids:
                return "stop"
        if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
            return "length"
        if self.handoff is not None and self.handoff.is_prefill:
            return HANDOFF_FINISH_REASON  # the decode instance takes it from here
        return None
