"""OpenAI request parsing and validation, response and error shapes.

Plain dicts in and out, no engine import: the cluster gateway can parse and answer requests
with this module alone. Every problem with a request becomes an ``APIError`` carrying the
HTTP status and the OpenAI error body, so no input reaches the engine unchecked.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.sampling_params import InvalidRequestError, SamplingParams

MAX_STOP_STRINGS = 16

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


def _is_int(value: Any) -> bool:
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
    return _get(body, name, _is_int, "an integer", default)


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
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise bad_request(f"'{name}' must be a list of integers >= 0", param=name)
    return value


def _refuse_unsupported(body: dict) -> None:
    """Options we do not implement are refused, not silently ignored."""
    if get_int(body, "n", 1) != 1:
        raise bad_request("only n=1 is supported", param="n")
    if get_int(body, "best_of", 1) != 1:
        raise bad_request("only best_of=1 is supported", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if get_number(body, name, 0.0) != 0.0:
            raise bad_request(f"'{name}' is not supported", param=name)
    if get_number(body, "repetition_penalty", 1.0) != 1.0:
        raise bad_request("'repetition_penalty' is not supported", param="repetition_penalty")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", param="logit_bias")
    if body.get("tools") or body.get("functions"):
        raise bad_request("tool calling is not supported", param="tools")


# ---- requests -----------------------------------------------------------------------------


@dataclass
class SamplingRequest:
    """The fields both endpoints share, read and type-checked."""

    model: str | None
    stream: bool
    include_usage: bool
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
    return_engine_timing: bool
    """Extension: chunks carry engine-side times (the overhead benchmark reads them)."""

    @classmethod
    def read(cls, body: dict, max_tokens: int | None) -> SamplingRequest:
        _refuse_unsupported(body)
        return cls(
            model=get_str(body, "model"),
            stream=get_bool(body, "stream"),
            include_usage=_include_usage(body),
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
            return_engine_timing=get_bool(body, "return_engine_timing"),
        )

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
                logprobs=self.logprobs, min_tokens=self.min_tokens)
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    return get_bool(options, "include_usage")


@dataclass
class CompletionRequest:
    sampling: SamplingRequest
    prompt: str | list[int]
    echo: bool = False

    @classmethod
    def parse(cls, body: dict) -> CompletionRequest:
        max_tokens = _positive(body, "max_tokens")
        sampling = SamplingRequest.read(body, max_tokens)
        logprobs = get_int(body, "logprobs")
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise bad_request("'logprobs' must be between 0 and 20", param="logprobs")
        sampling.logprobs = logprobs is not None
        if get_bool(body, "echo"):
            raise bad_request("'echo' is not supported", param="echo")
        if body.get("suffix"):
            raise bad_request("'suffix' is not supported", param="suffix")
        return cls(sampling, _read_prompt(body.get("prompt")))


def _positive(body: dict, name: str) -> int | None:
    value = get_int(body, name)
    if value is not None and value < 1:
        raise bad_request(f"'{name}' must be >= 1", param=name)
    return value


def _read_prompt(prompt: Any) -> str | list[int]:
    # A batch of one is accepted in both the text and the token-id form.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise bad_request("batched prompts are not supported: send one request per prompt",
                          param="prompt")
    raise bad_request("'prompt' must be a non-empty string or a list of token ids",
                      param="prompt")


@dataclass
class ChatRequest:
    sampling: SamplingRequest
    messages: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def parse(cls, body: dict) -> ChatRequest:
        max_tokens = _positive(body, "max_completion_tokens") or _positive(body, "max_tokens")
        sampling = SamplingRequest.read(body, max_tokens)
        sampling.logprobs = get_bool(body, "logprobs")
        if get_int(body, "top_logprobs", 0):
            raise bad_request("'top_logprobs' > 0 is not supported", param="top_logprobs")
        _refuse_response_format(body)
        return cls(sampling, _read_messages(body.get("messages")))


def _refuse_response_format(body: dict) -> None:
    response_format = body.get("response_format")
    if response_format is None:
        return
    if not isinstance(response_format, dict) or response_format.get("type") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported",
                          param="response_format")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _read_messages(messages: Any) -> list[dict[str, str]]:
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
    return {"role": role, "content": _message_text(message.get("content"), param)}


def _message_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}.content: only text parts are supported", param=param)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{param}.content must be a string or a list of text parts", param=param)


def check_token_ids(token_ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is not None and any(t >= vocab_size for t in token_ids):
        raise bad_request(f"token ids must be below the vocabulary size {vocab_size}",
                          param="prompt")


# ---- responses ----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Piece:
    """New output of one request since the last piece: text plus what clients may ask for."""

    text: str
    token_ids: list[int]
    token_texts: list[str]
    logprobs: list[float] | None
    finish_reason: str | None = None
    engine_time: float | None = None


def completion_logprobs(piece: Piece, offset: int) -> dict[str, Any]:
    offsets = []
    for text in piece.token_texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": piece.token_texts, "token_logprobs": piece.logprobs or [],
            "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(piece: Piece) -> dict[str, Any]:
    content = [{"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
               for text, lp in zip(piece.token_texts, piece.logprobs or [], strict=False)]
    return {"content": content}


def completion_choice(piece: Piece, with_logprobs: bool, offset: int = 0) -> dict[str, Any]:
    logprobs = completion_logprobs(piece, offset) if with_logprobs else None
    return {"index": 0, "text": piece.text, "logprobs": logprobs,
            "finish_reason": piece.finish_reason}


def chat_choice(piece: Piece, with_logprobs: bool, delta: bool) -> dict[str, Any]:
    logprobs = chat_logprobs(piece) if with_logprobs else None
    message: dict[str, Any] = {"content": piece.text} if piece.text or not delta else {}
    if not delta:
        message["role"] = "assistant"
    key = "delta" if delta else "message"
    return {"index": 0, key: message, "logprobs": logprobs, "finish_reason": piece.finish_reason}


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


_encode_str = json.JSONEncoder(ensure_ascii=False).encode


def dumps_str(text: str) -> bytes:
    return _encode_str(text).encode()


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_list(names: tuple[str, ...], max_model_len: int, created: int) -> dict[str, Any]:
    """One card per served name; ``root`` is the first (the name responses carry)."""
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "pdserve",
              "root": names[0], "max_model_len": max_model_len} for name in names]
    return {"object": "list", "data": cards}
