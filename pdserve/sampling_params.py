"""Per-request sampling settings, validated on construction (vLLM's field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token (OpenAI's limit)."""
LOGIT_BIAS_LIMIT = 100.0
"""Biases are clamped to [-100, 100], as OpenAI documents and vLLM does."""
MAX_BAD_WORDS = 64
"""Two variants a word, one refused token each per step: a small vocabulary keeps most."""


class TokenLogprob(float):
    """A sampled token's logprob carrying the most likely tokens at its step, ``top``:
    (token id, logprob) pairs, best first. Where no alternatives were asked for, logprobs
    are plain floats; this one reads as a float everywhere, so every layer between the
    sampler and the output passes it on unchanged."""

    __slots__ = ("top",)

    def __new__(cls, value: float, top: list[tuple[int, float]]) -> TokenLogprob:
        logprob = super().__new__(cls, value)
        logprob.top = top
        return logprob

    def __reduce__(self) -> tuple:
        return (TokenLogprob, (float(self), self.top))


PromptLogprob = tuple[float, int, list[tuple[int, float]]]
"""One prompt position as the engine scores it: the prompt token's logprob, its rank in the
vocabulary (1: the most likely) and the most likely tokens there as (id, logprob), best
first."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the problem (served as HTTP 400)."""


GRAMMAR_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """Output constrained by a grammar (``pdserve/structured``): plain data, so it crosses
    from the server to the engine process as it is."""

    kind: str
    """"json" (a JSON schema), "regex", "choice" (a JSON list of strings) or "grammar"
    (Lark, or GBNF / EBNF as llama.cpp writes it)."""
    source: str
    """The schema as JSON text, the regex, the choices as a JSON list, or the grammar."""
    field: str = "structured_outputs"
    """The request field it came from: errors name it."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 keeps all."""
    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same tokens."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the stop string is not included in the output text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation, in addition to the model's EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use this to fix the output length)."""
    logprobs: bool = False
    """Return the log-probability of each sampled token."""
    top_logprobs: int = 0
    """With ``logprobs``: also this many most likely tokens at each step (up to 20)."""
    prompt_logprobs: int | None = None
    """The logprob and rank of each prompt token after the first, with this many most likely
    tokens at its position (0 to 20); None: not computed. Such a request takes no prefix-cache
    hits: positions served from the cache have no logits."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated ([-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted once per time a token was already generated ([-2, 2])."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output (> 0)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's ([0, 1])."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> added to its logit before sampling (clamped to [-100, 100])."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids are sampled (greedy included); None: any."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated (as vLLM's): a word's last token is refused wherever the output
    ends with the rest of its tokens; each word also with a leading space, as it appears
    inside a text."""
    min_tokens: int = 0
    """EOS and stop tokens are ignored until this many tokens are generated."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended generation at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens (BOS, EOS, ...) out of the text."""
    priority: int = 0
    """Its place in the queue of waiting prompts under ``--prefill-order priority``: lower
    first, arrival order among equals (as vLLM's priority scheduling); any other order takes
    only 0."""
    grammar: GrammarSpec | None = None
    """Only tokens that keep the output inside this grammar are sampled (structured output)."""
    return_embedding: bool = False
    """Also return the prompt's embedding: the model's last hidden state (after the final
    norm) at the last prompt token, L2-normalized - last-token pooling, as decoder models
    used as embedders (E5-Mistral, GTE-Qwen) are pooled. The server's /v1/embeddings."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()
        self.logit_bias = {t: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(b)))
                           for t, b in self.logit_bias.items()}

    def validate(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens must be an integer >= 1")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               "top_k must be -1, 0 or a positive integer")
        # torch.Generator takes a signed or unsigned 64-bit seed; past that it raises
        # inside the engine, which would answer 500 instead of naming the field.
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
               "seed must be an integer in [-2**63, 2**64)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(len(self.bad_words) <= MAX_BAD_WORDS
               and all(isinstance(w, str) and w.strip() for w in self.bad_words),
               f"bad_words must be at most {MAX_BAD_WORDS} strings with a non-space character")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be integers >= 0")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be >= 0")
        _check(_is_int(self.priority), "priority must be an integer")
        _check(isinstance(self.return_embedding, bool), "return_embedding must be a boolean")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS),
               f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        self._validate_penalties()
        _check(self.allowed_token_ids is None
               or (isinstance(self.allowed_token_ids, (list, tuple)) and self.allowed_token_ids
                   and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
               "allowed_token_ids must be a non-empty list of token ids >= 0")
        # A grammar's tokens and the list could leave a step no token to sample.
        _check(self.allowed_token_ids is None or self.grammar is None,
               "allowed_token_ids cannot be combined with structured output")
        _check(not self.bad_words or (self.allowed_token_ids is None and self.grammar is None),
               "bad_words cannot be combined with allowed_token_ids or structured output "
               "(they could refuse every token a step may take)")
        _check(self.grammar is None or (isinstance(self.grammar, GrammarSpec)
                                        and self.grammar.kind in GRAMMAR_KINDS
                                        and isinstance(self.grammar.source, str)),
               f"grammar must be a GrammarSpec of kind {', '.join(GRAMMAR_KINDS)}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, f"{name} must be in [-2, 2]")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty must be > 0")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(all(_is_int(t) and t >= 0 and _is_num(b) and math.isfinite(b)
                   for t, b in self.logit_bias.items()),
               "logit_bias must map token ids >= 0 to finite numbers")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuses token ids the model does not have (they would index past its logits)."""
        _check(all(t < vocab_size for t in self.logit_bias),
               f"logit_bias token ids must be below the vocabulary size {vocab_size}")
        _check(all(t < vocab_size for t in self.allowed_token_ids or ()),
               f"allowed_token_ids must be below the vocabulary size {vocab_size}")

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
