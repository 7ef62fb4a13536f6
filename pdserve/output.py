"""From engine updates to what a caller shows: one request's text (incremental
detokenization), stop strings, per-token logprobs and the finish reason.

The offline ``LLM`` and the HTTP server both fold ``RequestUpdate``s through an
``OutputProcessor``, so they agree on every edge case: a stop string split across tokens, a
UTF-8 character split across byte tokens, tokens the engine sent past a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.messages import RequestUpdate
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.sampling_params import PromptLogprob, SamplingParams


@dataclass
class Logprob:
    """A token's logprob at one position, its rank there (1: the most likely) and its text:
    vLLM's ``Logprob``."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token (None for the first): the prompt token and the most likely tokens at
its position, by token id, as vLLM's ``RequestOutput.prompt_logprobs``."""


def prompt_logprobs_of(tokenizer: Tokenizer, prompt_token_ids: list[int],
                       scored: list[PromptLogprob | None], skip_special_tokens: bool
                       ) -> PromptLogprobs:
    """The engine's scores as vLLM shapes them: each position's dict holds the prompt token
    and the top alternatives (the prompt token once, when it is one of them)."""
    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens)

    out: PromptLogprobs = []
    for token, entry in zip(prompt_token_ids, scored, strict=True):
        if entry is None:
            out.append(None)
            continue
        logprob, rank, top = entry
        position = {t: Logprob(lp, r, text(t)) for r, (t, lp) in enumerate(top, start=1)}
        position.setdefault(token, Logprob(logprob, rank, text(token)))
        out.append(position)
    return out


@dataclass
class OutputDelta:
    """What one ``process`` call adds to a request's output."""

    text: str
    token_ids: list[int]
    """The tokens this text came from (cut at the token that completed a stop string)."""
    token_texts: list[str]
    """Each token decoded on its own; filled only when logprobs were asked for."""
    logprobs: list[float] | None
    """Aligned with ``token_ids``; None unless logprobs were asked for."""
    finish_reason: str | None = None
    abort: bool = False
    """A stop string ended the request while the engine still runs it: abort it there."""
    top_logprobs: list[list[tuple[str, float]]] | None = None
    """Per token, the most likely tokens at its step as (text, logprob), best first; None
    unless alternatives were asked for."""
    prompt_logprobs: PromptLogprobs | None = None
    """In the delta of the request's first token, when prompt logprobs were asked for."""


def token_id_name(token: int) -> str:
    return f"token_id:{token}"


class OutputProcessor:
    """Folds one request's ``RequestUpdate``s into an ``OutputDelta`` per call."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams, tokens_as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids  # logprobs name tokens "token_id:N" (vLLM's)
        self.want_logprobs = params.logprobs
        self.want_top_logprobs = params.logprobs and params.top_logprobs > 0
        self.include_stop = params.include_stop_str_in_output
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop,
                                            params.skip_special_tokens)
        self.prompt_token_ids = prompt_token_ids
        self._prompt_scores: list[PromptLogprob | None] | None = None
        self.finished = False
        self.num_generated = 0
        self.num_cached_tokens = 0
        self.embedding: list[float] | None = None  # ``return_embedding``: with the first token
        self._unsent = ""  # resumed text the client has not got yet
        self._skip = 0  # characters of coming text the client already got
        self.resumed_text = ""
        """P/D resume: the text the client already got (what a reader of the whole text,
        a reasoning split, must have seen before this instance's text)."""
        self.resumed_tokens = 0  # and the tokens it got

    def process(self, updates: Iterable[RequestUpdate]) -> OutputDelta:
        """The output these updates add; nothing once the request has finished."""
        if self.finished:  # tokens past a stop string, sent before the engine saw the abort
            return OutputDelta("", [], [], [] if self.want_logprobs else None,
                               top_logprobs=[] if self.want_top_logprobs else None)
        ids, logprobs, reason = self._gather(updates)
        text, ids = self._text(ids, reason)
        if self._unsent or self._skip:
            text = self._after_resume(text)
        abort = self.detok.stopped and reason is None
        if self.detok.stopped:
            reason = "stop"
        self.finished = reason is not None
        self.num_generated += len(ids)
        prompt_logprobs = self._prompt_logprobs()
        if not self.want_logprobs:  # the common case: no per-token texts to decode
            return OutputDelta(text, ids, [], None, reason, abort, None, prompt_logprobs)
        logprobs = logprobs[:len(ids)]
        return OutputDelta(text, ids, self._token_texts(ids), logprobs, reason, abort,
                           self._alternatives(logprobs), prompt_logprobs)

    def _prompt_logprobs(self) -> PromptLogprobs | None:
        scored, self._prompt_scores = self._prompt_scores, None
        if scored is None:
            return None
        return prompt_logprobs_of(self.tokenizer, self.prompt_token_ids, scored,
                                  self.detok.skip_special_tokens)

    def resume(self, token_ids: list[int], text_chars: int) -> None:
        """Output another instance already streamed (P/D resume): ``token_ids``, of whose text
        the client got ``text_chars`` characters. Both detokenizers emit prefixes of one
        text: what this one emits beyond what the client got goes out first; if it emits
        less (text held back there), that much of the coming text is dropped."""
        text = self.detok.push(token_ids)
        self.num_generated += len(token_ids)
        self._unsent = text[text_chars:]
        self._skip = max(0, text_chars - len(text))
        self.resumed_text = text[:text_chars]
        self.resumed_tokens = len(token_ids)

    def _after_resume(self, text: str) -> str:
        skipped = min(self._skip, len(text))
        self.resumed_text += text[:skipped]
        text, self._unsent = self._unsent + text[skipped:], ""
        self._skip -= skipped
        return text

    def _gather(self, updates: Iterable[RequestUpdate]
                ) -> tuple[list[int], list[float], str | None]:
        ids: list[int] = []
        logprobs: list[float] = []
        reason = None
        for update in updates:
            ids += update.new_token_ids
            logprobs += update.new_logprobs or []
            self.num_cached_tokens = update.num_cached_tokens
            if update.prompt_logprobs is not None:
                self._prompt_scores = update.prompt_logprobs
            if update.embedding is not None:
                self.embedding = update.embedding
            if update.finished:
                reason = update.finish_reason
                break
        return ids, logprobs, reason

    def _text(self, ids: list[int], reason: str | None) -> tuple[str, list[int]]:
        """The newly final text and the tokens it used (fewer when a stop string hit)."""
        if self.detok.stop and len(ids) > 1:
            text, ids = self._push_one_by_one(ids)
        else:
            text = self.detok.push(ids)
        if self.detok.stopped:
            return text + (self.detok.stop_reason if self.include_stop else ""), ids
        if reason is not None:
            text += self.detok.flush()
        return text, ids

    def _push_one_by_one(self, ids: list[int]) -> tuple[str, list[int]]:
        # Token by token, so that the tokens after the one completing a stop string are
        # neither counted nor given logprobs.
        pieces = []
        for used, token in enumerate(ids, start=1):
            pieces.append(self.detok.push([token]))
            if self.detok.stopped:
                return "".join(pieces), ids[:used]
        return "".join(pieces), ids

    def _alternatives(self, logprobs: list[float]) -> list[list[tuple[str, float]]] | None:
        if not self.want_top_logprobs:
            return None
        return [[(self._token_name(token), value) for token, value in getattr(lp, "top", ())]
                for lp in logprobs]

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self._token_name(i) for i in ids]

    def _token_name(self, token: int) -> str:
        """How logprobs name a token: its text, or ``token_id:N`` (the id itself, for
        clients that need it exactly: texts of byte pieces can collide or not decode)."""
        if self.tokens_as_ids:
            return token_id_name(token)
        return self.tokenizer.decode([token], self.detok.skip_special_tokens)
