"""OpenAI request parsing and validation, response and error shapes.

Plain dicts in and out, no engine import: the cluster gateway can parse and answer requests
with this module alone. Every problem with a request becomes an ``APIError`` carrying the
HTTP status and the OpenAI error body, so no input reaches the engine unchecked.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pdserve.beam_search import MAX_WIDTH as MAX_BEAM_WIDTH
from pdserve.model.chat import message_text
from pdserve.sampling_params import (
    MAX_TOP_LOGPROBS,
    GrammarSpec,
    InvalidRequestError,
    SamplingParams,
)

if TYPE_CHECKING:  # the gateway imports this module without the tokenizer's dependencies
    from pdserve.output import Logprob, PromptLogprobs

MAX_STOP_STRINGS = 16
MAX_CHOICES = 64
"""Most choices (``n``, ``best_of``) per request: each is an engine request of its own."""
MAX_BATCH_REQUESTS = 1024
"""Most engine requests one ``/v1/completions`` request may start: its prompts times the
choices each generates."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An answer in the OpenAI error shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
"""vLLM's scoring routes (``server/embeddings.py``): served by an instance, relayed whole by
a gateway."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


# ---- typed field readers ------------------------------------------------------------------


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _get(body: dict, name: str, check, kind: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad_request(f"'{name}' must be {kind}, got {type(value).__name__}", param=name)
    return value


def get_int(body: dict, name: str, default: int | None = None) -> int | None:
    return _get(body, name, is_int, "an integer", default)


def get_number(body: dict, name: str, default: float | None = None) -> float | None:
    value = _get(body, name, _is_number, "a number", default)
    return None if value is None else float(value)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    return _get(body, name, lambda v: isinstance(v, bool), "a boolean", default)


def get_str(body: dict, name: str, default: str | None = None) -> str | None:
    return _get(body, name, lambda v: isinstance(v, str), "a string", default)


def get_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return stop


def get_int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(v) and v >= 0 for v in value):
        raise bad_request(f"'{name}' must be a list of integers >= 0", param=name)
    return value


# ---- which fields each endpoint takes ------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """A feature this server lacks: the field is taken only at a value that turns it off."""

    reason: str
    off: tuple[Any, ...] = ()
    """Values that mean "feature off" (null always does); any other value is a 400."""


HONOURED = "honoured"
FieldRule = str | Refused

_SAMPLER = "the engine's sampler does not implement it"
_TOOLS = "the legacy function calling fields are not implemented; use 'tools'"
_STORE = "completions are not stored"

_SHARED_FIELDS: dict[str, FieldRule] = {
    **dict.fromkeys(("model", "stream", "stream_options", "max_tokens", "temperature", "top_p",
                     "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                     "logprobs", "skip_special_tokens", "include_stop_str_in_output",
                     "add_special_tokens", "user", "return_engine_timing", "n",
                     "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "logit_bias", "min_p", "response_format", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "structured_outputs",
                     "prompt_logprobs", "allowed_token_ids", "truncate_prompt_tokens",
                     "guided_whitespace_pattern", "use_beam_search", "length_penalty",
                     "bad_words", "priority", "return_tokens_as_token_ids", "request_id"),
                    HONOURED),
    "logits_processors": Refused(_SAMPLER, ([],)),
    "guided_decoding_backend": Refused("structured output always runs on llguidance",
                                       ("llguidance", "guidance", "auto")),
    "spaces_between_special_tokens": Refused("special tokens are always decoded as the "
                                             "tokenizer joins them", (True,)),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **_SHARED_FIELDS,
    "prompt": HONOURED,
    "echo": HONOURED,
    "best_of": HONOURED,
    "suffix": Refused("insertion (suffix) is not implemented", ("",)),
}
"""``/v1/completions``: every field it takes; any other is refused with 400."""

CHAT_FIELDS: dict[str, FieldRule] = {
    **_SHARED_FIELDS,
    **dict.fromkeys(("messages", "max_completion_tokens", "add_generation_prompt",
                     "continue_final_message", "chat_template", "chat_template_kwargs",
                     "include_reasoning", "echo", "documents"),
                    HONOURED),
    "top_logprobs": HONOURED,
    **dict.fromkeys(("tools", "tool_choice", "parallel_tool_calls"), HONOURED),
    "functions": Refused(_TOOLS, ([],)),
    "function_call": Refused(_TOOLS, ("none",)),
    "audio": Refused("only text output"),
    "modalities": Refused("only text output", (["text"],)),
    "mm_processor_kwargs": Refused("only text input"),
    "prediction": Refused("predicted outputs are not implemented"),
    "reasoning_effort": Refused("reasoning effort control is not implemented"),
    "web_search_options": Refused("web search is not available"),
    "service_tier": Refused("there is one service tier", ("auto", "default")),
    "store": Refused(_STORE, (False,)),
    "metadata": Refused(_STORE),
}
"""``/v1/chat/completions``: every field it takes; any other is refused with 400."""


def check_fields(body: dict, rules: dict[str, FieldRule], endpoint: str) -> None:
    """Refuses (400, ``param`` = the field) unknown fields and features switched on that
    this server lacks; the honoured fields are read by the parsers."""
    for name, value in body.items():
        rule = rules.get(name)
        if rule is None:
            raise bad_request(f"unknown field '{name}' for {endpoint}", param=name)
        if isinstance(rule, Refused) and not _is_off(value, rule.off):
            raise bad_request(f"'{name}' is not supported: {rule.reason}", param=name)


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    # Compared with the type too: False == 0 in Python, but false is no penalty value.
    return value is None or any(type(value) is type(o) and value == o for o in off)


# ---- requests -----------------------------------------------------------------------------


@dataclass
class SamplingRequest:
    """The fields both endpoints share, read and type-checked."""

    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    """Every chunk carries the usage so far (``stream_options.continuous_usage_stats``)."""
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    add_special_tokens: bool | None
    """None: the endpoint's default (completions add BOS, chat templates write their own)."""
    user: str | None
    """The caller's end-user id; written in the request log line."""
    return_engine_timing: bool
    """Extension: chunks carry engine-side times (the overhead benchmark reads them)."""
    penalties: dict[str, float]
    """presence_penalty, frequency_penalty, repetition_penalty, min_p as sent."""
    logit_bias: dict[int, float]
    allowed_token_ids: list[int] | None
    """vLLM extension: only these tokens are sampled; None: any."""
    n: int
    """Choices returned."""
    top_logprobs: int = 0
    """Alternatives per token (chat ``top_logprobs``, completions ``logprobs: N``)."""
    best_of: int = 1
    """Choices generated (completions): the ``n`` with the highest sum of logprobs return."""
    grammar: GrammarSpec | None = None
    """Structured output: the grammar every choice follows (``pdserve/server/guided.py``)."""
    prompt_logprobs: int | None = None
    """vLLM extension: the prompt tokens' logprobs with this many alternatives each."""
    echo_logprobs: bool = False
    """Completions with ``echo`` and ``logprobs``: the prompt's tokens lead the logprobs."""
    truncate_prompt_tokens: int | None = None
    """vLLM extension: keep only the prompt's last k tokens (-1: the model's context)."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM extension: words never generated."""
    priority: int = 0
    """vLLM extension: lower first among waiting prompts (``--prefill-order priority``)."""
    tokens_as_ids: bool = False
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token ``token_id:N``."""
    beam_search: bool = False
    """vLLM's ``use_beam_search``: ``max(n, best_of)`` beams, the best ``n`` returned
    (``pdserve/beam_search.py``)."""
    length_penalty: float = 1.0

    @classmethod
    def read(cls, body: dict, max_tokens: int | None) -> SamplingRequest:
        return cls(
            model=get_str(body, "model"),
            stream=get_bool(body, "stream"),
            include_usage=_include_usage(body),
            continuous_usage=_continuous_usage(body),
            max_tokens=max_tokens,
            temperature=get_number(body, "temperature", 1.0),
            top_p=get_number(body, "top_p", 1.0),
            top_k=get_int(body, "top_k", -1),
            seed=get_int(body, "seed"),
            stop=get_stop(body),
            stop_token_ids=get_int_list(body, "stop_token_ids"),
            ignore_eos=get_bool(body, "ignore_eos"),
            min_tokens=get_int(body, "min_tokens", 0),
            logprobs=False,
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
            add_special_tokens=_optional_bool(body, "add_special_tokens"),
            user=get_str(body, "user"),
            return_engine_timing=get_bool(body, "return_engine_timing"),
            penalties={name: get_number(body, name, off) for name, off in _PENALTIES.items()},
            logit_bias=_logit_bias(body),
            allowed_token_ids=_allowed_token_ids(body),
            n=_choices(body, "n"),
            prompt_logprobs=_prompt_logprobs(body),
            truncate_prompt_tokens=_truncate_prompt_tokens(body),
            bad_words=_get(body, "bad_words", lambda v: isinstance(v, list), "a list", []),
            priority=get_int(body, "priority", 0),
            tokens_as_ids=get_bool(body, "return_tokens_as_token_ids"),
            beam_search=get_bool(body, "use_beam_search"),
            length_penalty=get_number(body, "length_penalty", 1.0),
        )

    @property
    def scored_prompt_width(self) -> int | None:
        """Alternatives the engine computes per prompt token; None: the prompt is not
        scored."""
        if self.echo_logprobs:
            return max(self.prompt_logprobs or 0, self.top_logprobs)
        return self.prompt_logprobs

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int,
                        default_max_tokens: int | None) -> SamplingParams:
        """Checks the context budget, then builds (and so validates) ``SamplingParams``."""
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise bad_request(f"the prompt has {num_prompt_tokens} tokens; this model's context "
                              f"is {max_model_len} tokens", param="prompt",
                              code="context_length_exceeded")
        max_tokens = self.max_tokens or default_max_tokens or room
        if self.max_tokens is not None and max_tokens > room:
            raise bad_request(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) "
                              f"exceeds this model's context of {max_model_len} tokens",
                              param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(
                max_tokens=min(max_tokens, room), temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                logprobs=self.logprobs, min_tokens=self.min_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, top_logprobs=self.top_logprobs,
                logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words, priority=self.priority, grammar=self.grammar,
                prompt_logprobs=self.scored_prompt_width, **self.penalties)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param=_field_named(str(exc))) from None

    @property
    def num_generated_choices(self) -> int:
        return max(self.n, self.best_of)


_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
              "min_p": 0.0}
_PARAM_NAMES = {*_PENALTIES, "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                "stop_token_ids", "min_tokens", "top_logprobs", "logit_bias",
                "allowed_token_ids", "bad_words", "priority"}


def _field_named(message: str) -> str | None:
    """The request field a ``SamplingParams`` message starts with (they all name it first)."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


def _logit_bias(body: dict) -> dict[int, float]:
    bias = _get(body, "logit_bias", lambda v: isinstance(v, dict), "an object", {})
    try:  # JSON object keys are strings: OpenAI sends token ids as "50256"
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise bad_request("'logit_bias' keys must be token ids (integers as strings)",
                          param="logit_bias") from None


def _truncate_prompt_tokens(body: dict) -> int | None:
    keep = get_int(body, "truncate_prompt_tokens")
    if keep is not None and keep < 1 and keep != -1:
        raise bad_request("'truncate_prompt_tokens' must be -1 (the model's context) or >= 1",
                          param="truncate_prompt_tokens")
    return keep


def _allowed_token_ids(body: dict) -> list[int] | None:
    if body.get("allowed_token_ids") is None:
        return None
    allowed = get_int_list(body, "allowed_token_ids")
    if not allowed:
        raise bad_request("'allowed_token_ids' must not be empty (null allows every token)",
                          param="allowed_token_ids")
    return allowed


def _choices(body: dict, name: str, least: int = 1) -> int:
    value = get_int(body, name, least)
    if not least <= value <= MAX_CHOICES:
        raise bad_request(f"'{name}' must be in [{least}, {MAX_CHOICES}]", param=name)
    return value


def _top_logprobs(value: int | None, name: str) -> int:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'{name}' must be in [0, {MAX_TOP_LOGPROBS}]", param=name)
    return value or 0


def _prompt_logprobs(body: dict) -> int | None:
    value = get_int(body, "prompt_logprobs")
    if value is None:
        return None
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'prompt_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]",
                          param="prompt_logprobs")
    if get_bool(body, "stream"):  # as vLLM: they come with the whole answer only
        raise bad_request("'prompt_logprobs' is not available when 'stream' is true",
                          param="prompt_logprobs")
    return value


def _optional_bool(body: dict, name: str) -> bool | None:
    return get_bool(body, name) if body.get(name) is not None else None


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad_request(f"'stream_options' has no field {unknown[0]!r} here (it takes "
                          "'include_usage' and 'continuous_usage_stats')",
                          param="stream_options")
    return get_bool(options, "include_usage")


def _continuous_usage(body: dict) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so
    far; as in vLLM, only beside ``include_usage`` (alone it is refused, not ignored)."""
    options = body.get("stream_options") or {}
    if not get_bool(options, "continuous_usage_stats"):
        return False
    if not get_bool(options, "include_usage"):
        raise bad_request("'stream_options.continuous_usage_stats' needs 'include_usage': true",
                          param="stream_options")
    return True


@dataclass
class CompletionRequest:
    sampling: SamplingRequest
    prompts: list[str | list[int]]
    """One prompt, or a batch: each answered with its own ``n`` choices, in order."""
    echo: bool = False

    @classmethod
    def parse(cls, body: dict) -> CompletionRequest:
        check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        max_tokens = _positive(body, "max_tokens")
        sampling = SamplingRequest.read(body, max_tokens)
        logprobs = get_int(body, "logprobs")
        sampling.top_logprobs = _top_logprobs(logprobs, "logprobs")
        sampling.logprobs = logprobs is not None
        sampling.best_of = _choices(body, "best_of", least=sampling.n)
        if sampling.best_of > sampling.n and sampling.stream:
            raise bad_request("'best_of' larger than 'n' cannot stream: the best choices are "
                              "known only at the end", param="best_of")
        echo = get_bool(body, "echo")
        sampling.echo_logprobs = echo and sampling.logprobs
        check_beam_search(body, sampling)
        prompts = read_prompts(body.get("prompt"))
        if sampling.beam_search and len(prompts) > 1:
            raise bad_request("'use_beam_search' takes one prompt per request", param="prompt")
        if len(prompts) * sampling.num_generated_choices > MAX_BATCH_REQUESTS:
            raise bad_request(f"{len(prompts)} prompts of {sampling.num_generated_choices} "
                              f"choices each are more than the {MAX_BATCH_REQUESTS} "
                              "generations one request may ask for", param="prompt")
        return cls(sampling, prompts, echo)


# The fields a beam search cannot honour, with the values that leave them off: it samples
# nothing (no temperature, seed or filters), stops only at end of sequence or max_tokens,
# and returns no logprobs.
_BEAM_CONFLICTS: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "temperature": (0,), "top_p": (1,), "top_k": (-1, 0), "min_p": (0,),
    "seed": (), "stop": ([], ""), "stop_token_ids": ([],), "min_tokens": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "allowed_token_ids": (), "bad_words": ([],), "logprobs": (False,),
    "top_logprobs": (0,), "prompt_logprobs": (), "response_format": ({"type": "text"},),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (),
}


def _beam_search_conflict(body: dict[str, Any]) -> str | None:
    """The first field of ``body`` a beam search cannot honour, at a value that asks for
    it; None when there is none."""
    for name, off in _BEAM_CONFLICTS.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in off):
            return name
    return None


def _same(value: Any, off: Any) -> bool:
    if isinstance(value, bool) or isinstance(off, bool):  # completions' logprobs: 0 is on
        return value is off
    return value == off


def check_beam_search(body: dict, sampling: SamplingRequest) -> None:
    """``use_beam_search`` with only what a beam search honours; ``length_penalty`` only
    with it."""
    if not sampling.beam_search:
        if sampling.length_penalty != 1.0:
            raise bad_request("'length_penalty' ranks beams: it needs 'use_beam_search': "
                              "true", param="length_penalty")
        return
    conflict = _beam_search_conflict(body)
    if conflict is not None:
        raise bad_request(f"'{conflict}' cannot be used with 'use_beam_search': a beam "
                          "search samples nothing, stops only at the end of sequence or "
                          "max_tokens, and returns no logprobs", param=conflict)
    if sampling.num_generated_choices > MAX_BEAM_WIDTH:
        raise bad_request(f"a beam search keeps at most {MAX_BEAM_WIDTH} beams ('n', 'best_of')",
                          param="n")


def _positive(body: dict, name: str) -> int | None:
    value = get_int(body, name)
    if value is not None and value < 1:
        raise bad_request(f"'{name}' must be >= 1", param=name)
    return value


def read_prompts(prompt: Any, name: str = "prompt") -> list[str | list[int]]:
    """``prompt`` (the field ``name``: ``input`` on embeddings) as the prompts it holds: a
    string or a list of token ids is one; a list of either is a batch (OpenAI's and vLLM's
    forms)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_read_prompt(p, name) for p in prompt]
    return [_read_prompt(prompt, name)]


def _read_prompt(prompt: Any, name: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"'{name}' is empty", param=name)
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        return prompt
    raise bad_request(f"'{name}' must be a non-empty string, a list of token ids, or a list "
                      "of either", param=name)


@dataclass
class ChatRequest:
    sampling: SamplingRequest
    messages: list[dict[str, str]] = field(default_factory=list)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    """A Jinja template for this request instead of the model's."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables the template sees."""
    include_reasoning: bool = True
    """vLLM's: with ``--reasoning-parser``, false leaves the reasoning out of the answer."""
    echo: bool = False
    """vLLM's: the answer starts with the last message's content when it is the
    assistant's (the message the answer goes on)."""

    @classmethod
    def parse(cls, body: dict) -> ChatRequest:
        check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
        max_tokens = _positive(body, "max_completion_tokens") or _positive(body, "max_tokens")
        sampling = SamplingRequest.read(body, max_tokens)
        sampling.logprobs = get_bool(body, "logprobs")
        sampling.top_logprobs = _top_logprobs(get_int(body, "top_logprobs"), "top_logprobs")
        if sampling.top_logprobs and not sampling.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        check_beam_search(body, sampling)
        return cls(sampling, read_messages(body.get("messages")), **read_template_options(body),
                   include_reasoning=get_bool(body, "include_reasoning", True),
                   echo=get_bool(body, "echo"))


_TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "bos_token", "eos_token"}


def read_template_options(body: dict) -> dict[str, Any]:
    """How to render the chat template (``/v1/chat/completions`` and ``/tokenize``)."""
    options = {"add_generation_prompt": get_bool(body, "add_generation_prompt", True),
               "continue_final_message": get_bool(body, "continue_final_message"),
               "chat_template": get_str(body, "chat_template"),
               "chat_template_kwargs": _get(body, "chat_template_kwargs",
                                            lambda v: isinstance(v, dict), "an object", {})}
    reserved = _TEMPLATE_VARIABLES & set(options["chat_template_kwargs"])
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: "
                          "the server sets them", param="chat_template_kwargs")
    documents = _get(body, "documents", _is_documents, "a list of objects of strings", None)
    if documents is not None:
        if "documents" in options["chat_template_kwargs"]:
            raise bad_request("'documents' is given twice: as a field and in "
                              "chat_template_kwargs", param="documents")
        options["chat_template_kwargs"] = {**options["chat_template_kwargs"],
                                           "documents": documents}
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise bad_request("'continue_final_message' continues the last message, so it needs "
                          "'add_generation_prompt': false", param="continue_final_message")
    return options


def _is_documents(value: Any) -> bool:
    """vLLM's ``documents``: what a retrieval-augmented chat template reads, e.g.
    ``[{"title": ..., "text": ...}]``."""
    return isinstance(value, list) and all(
        isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str)
                                    for k, v in d.items()) for d in value)


_ROLES = ("system", "developer", "user", "assistant", "tool")


def read_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    return [_read_message(m, i) for i, m in enumerate(messages)]


def _read_message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param=param)
    role = message.get("role")
    if role not in _ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(_ROLES)}", param=param)
    read = {"role": role, "content": _message_text(message.get("content"), param)}
    # A tool-calling conversation: the assistant's calls and each tool result's call id go
    # to the chat template as the client sent them.
    read.update({k: message[k] for k in _TOOL_MESSAGE_KEYS if message.get(k) is not None})
    return read


_TOOL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")


def _message_text(content: Any, param: str) -> str:
    try:
        return message_text(content)
    except ValueError as exc:
        raise bad_request(f"{param}.content: {exc}", param=param) from None


def check_priority(sampling: SamplingRequest, prefill_order: str | None) -> None:
    """A priority other than 0 only where the engine orders its queue by it (as vLLM
    refuses one without priority scheduling)."""
    if sampling.priority != 0 and prefill_order != "priority":
        raise bad_request("'priority' other than 0 needs a server started with "
                          "--prefill-order priority", param="priority")


def check_sampling_token_ids(sampling: SamplingRequest, vocab_size: int | None) -> None:
    """The token ids a request's sampling names exist in the model's vocabulary."""
    check_token_ids(list(sampling.logit_bias), vocab_size, "logit_bias")
    check_token_ids(sampling.allowed_token_ids or [], vocab_size, "allowed_token_ids")


def check_token_ids(token_ids: list[int], vocab_size: int | None, param: str = "prompt"
                    ) -> None:
    if vocab_size is not None and any(t >= vocab_size for t in token_ids):
        raise bad_request(f"token ids must be below the vocabulary size {vocab_size}",
                          param=param)


# ---- responses ----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256


def with_request_id_header(body: dict, headers) -> dict:
    """The body with the client's ``X-Request-Id`` header as its ``request_id``: the header
    wins over the field, as in vLLM (a P/D gateway passes it on to its instances so)."""
    header = headers.get(REQUEST_ID_HEADER)
    if header is None or not isinstance(body, dict):
        return body
    return {**body, "request_id": header}


def answer_ids(prefix: str, body: dict) -> tuple[str, str]:
    """The answer's id and the engine's key for it. A client's ``request_id`` (vLLM's field;
    its ``X-Request-Id`` header stands for it) names the answer ``prefix-<request_id>``, as
    vLLM does; the engine's key adds a random suffix, so two requests sent with one id
    never share the engine's key (one's abort cannot end the other)."""
    value = body.get("request_id")
    if value is None:
        answer = new_id(prefix)
        return answer, answer
    if not isinstance(value, str) or not value or len(value) > MAX_REQUEST_ID_CHARS \
            or not value.isprintable():
        raise bad_request(f"'request_id' (or the {REQUEST_ID_HEADER} header) must be 1 to "
                          f"{MAX_REQUEST_ID_CHARS} printable characters", param="request_id")
    answer = f"{prefix}-{value}"
    return answer, f"{answer}-{uuid.uuid4().hex[:8]}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``reasoning_tokens`` (those of a reasoning model's thought, where
    counted) in ``completion_tokens_details``."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def reasoning_tokens(usage: dict[str, Any]) -> int | None:
    return (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")


def summed_usage(usages: list[dict[str, Any]], per_prompt: int = 1) -> dict[str, Any]:
    """The usage of several answers as one: a batch's prompts, or (a gateway's parts)
    ``per_prompt`` answers of each prompt in a row, whose prompt - and the cached tokens
    it found - counts once (its first answer's); every output token counts."""
    firsts = usages[::per_prompt]
    thoughts = [reasoning_tokens(u) for u in usages]
    return usage(sum(u["prompt_tokens"] for u in firsts),
                 sum(u["completion_tokens"] for u in usages),
                 sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                     for u in firsts),
                 None if None in thoughts else sum(thoughts))


@dataclass(slots=True)
class Piece:
    """New output of one request since the last piece: text plus what clients may ask for."""

    text: str
    token_ids: list[int]
    token_texts: list[str]
    logprobs: list[float] | None
    finish_reason: str | None = None
    engine_time: float | None = None
    top_logprobs: list[list[tuple[str, float]]] | None = None
    """Per token, (text, logprob) of the most likely tokens; None unless asked for."""
    index: int = 0
    """Which choice (``n`` > 1) this output belongs to."""
    prompt_logprobs: PromptLogprobs | None = None
    """In the request's first piece, when the prompt was scored."""


def completion_logprobs(piece: Piece, offset: int) -> dict[str, Any]:
    offsets = []
    for text in piece.token_texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": piece.token_texts, "token_logprobs": piece.logprobs or [],
            "top_logprobs": _completion_top(piece), "text_offset": offsets}


def _completion_top(piece: Piece) -> list[dict[str, float]] | None:
    # As OpenAI's legacy completions (and vLLM): the N best, plus the sampled token when it
    # is not among them. Keys are texts: two tokens with one text (byte tokens that decode
    # to U+FFFD) share an entry, and the sampled token's own logprob is the one kept.
    if piece.top_logprobs is None:
        return None
    return [None if lp is None else {**dict(top), text: lp} for text, lp, top in
            zip(piece.token_texts, piece.logprobs or [], piece.top_logprobs, strict=True)]


def chat_logprobs(piece: Piece) -> dict[str, Any]:
    tops = piece.top_logprobs or [[]] * len(piece.token_texts)
    content = [{**_chat_token(text, lp), "top_logprobs": [_chat_token(*t) for t in top]}
               for text, lp, top in zip(piece.token_texts, piece.logprobs or [], tops,
                                        strict=False)]
    return {"content": content}


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def completion_choice(piece: Piece, with_logprobs: bool, offset: int = 0) -> dict[str, Any]:
    logprobs = completion_logprobs(piece, offset) if with_logprobs else None
    return {"index": piece.index, "text": piece.text, "logprobs": logprobs,
            "finish_reason": piece.finish_reason}


def prompt_logprobs_json(scored: PromptLogprobs, prompt_ids: list[int], width: int
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (null for the first), by token id, the
    prompt token and the ``width`` most likely (the engine may have scored more, for echo)."""
    return [None if position is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in position.items() if lp.rank <= width or t == token}
            for token, position in zip(prompt_ids, scored, strict=True)]


def echo_logprobs(piece: Piece, prompt_ids: list[int], prompt_texts: list[str], width: int,
                  tokens_as_ids: bool = False) -> Piece:
    """``piece`` with the prompt's tokens before its own, as completions ``echo`` with
    ``logprobs`` answers: the first has no logprob (nothing predicts it). The alternatives
    are named by their text, or ``token_id:N`` with ``tokens_as_ids``."""
    from pdserve.output import token_id_name  # the gateway imports this module without it

    scored = piece.prompt_logprobs or [None] * len(prompt_ids)
    logprobs = [None if p is None else p[t].logprob
                for t, p in zip(prompt_ids, scored, strict=True)]
    tops = [None if p is None else
            [(token_id_name(t) if tokens_as_ids else lp.decoded_token, lp.logprob)
             for t, lp in sorted(p.items(), key=_by_rank) if lp.rank <= width]
            for p in scored]
    return replace(piece, token_texts=prompt_texts + piece.token_texts,
                   logprobs=logprobs + (piece.logprobs or []),
                   top_logprobs=tops + piece.top_logprobs
                   if piece.top_logprobs is not None else None)


def _by_rank(entry: tuple[int, Logprob]) -> int:
    return entry[1].rank


def chat_choice(piece: Piece, with_logprobs: bool, delta: bool) -> dict[str, Any]:
    logprobs = chat_logprobs(piece) if with_logprobs else None
    message: dict[str, Any] = {"content": piece.text} if piece.text or not delta else {}
    if not delta:
        message["role"] = "assistant"
    key = "delta" if delta else "message"
    return {"index": piece.index, key: message, "logprobs": logprobs,
            "finish_reason": piece.finish_reason}


def envelope(request_id: str, kind: str, model: str, created: int,
             choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None,
             with_usage_key: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": kind, "created": created,
                            "model": model, "choices": choices}
    if usage_body is not None or with_usage_key:
        body["usage"] = usage_body
    return body


def dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


# The C function ``json.dumps(..., ensure_ascii=False)`` encodes every string with, called
# without an encoder object in between: a streamed chunk's text goes through it once.
_encode_str = json.encoder.encode_basestring


def dumps_str(text: str) -> bytes:
    return _encode_str(text).encode()


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def model_card(cards: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """``GET /v1/models/{model}``: the card of ``name``; a 404 when it is not served."""
    for card in cards:
        if card["id"] == name:
            return card
    raise APIError(404, f"model '{name}' is not served here", param="model",
                   code="model_not_found")


def models_list(names: tuple[str, ...], max_model_len: int, created: int) -> dict[str, Any]:
    """One card per served name; ``root`` is the first (the name responses carry)."""
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "pdserve",
              "root": names[0], "max_model_len": max_model_len} for name in names]
    return {"object": "list", "data": cards}
