"""The OpenAI endpoints' logic: tokenize, submit to the engine, turn token deltas into text
(incremental detokenization and stop strings happen here, off the engine's loop) and
answer as one JSON body or as server-sent events.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from jinja2 import TemplateSyntaxError

from pdserve.aio import gather_or_cancel
from pdserve.beam_search import Beam, beam_search
from pdserve.handoff import KVHandoff
from pdserve.messages import RequestUpdate
from pdserve.model.tokenizer import Tokenizer
from pdserve.output import OutputProcessor, token_id_name
from pdserve.sampling_params import SamplingParams
from pdserve.server import protocol as P
from pdserve.server.client import EngineClient, Items, RequestStream
from pdserve.server.guided import check, read_grammar
from pdserve.server.metrics import RequestTiming, ServerMetrics
from pdserve.server.reasoning import ThinkSplitter, split_reasoning
from pdserve.server.tool_calls import ToolRequest, ToolSettings, ToolStream

logger = logging.getLogger(__name__)

# Prompts longer than this are tokenized on a worker thread so that one long prompt does
# not stall every stream sharing the event loop.
INLINE_TOKENIZE_CHARS = 4096
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# The dispatcher writes a chunk itself only while the socket's send buffer stays under this,
# well below the transport's high-water mark (64 KiB), so its write never has to wait.
INLINE_WRITE_LIMIT = 16 * 1024


@dataclass(frozen=True)
class Resumed:
    """Output an instance that failed had already streamed (``pdserve/server/pd.py``): its
    token ids, and how many characters of text the client got. The detokenizer may have
    held back the text of the last tokens (a partial character, a possible stop string), so
    the two need not match."""

    token_ids: list[int]
    text_chars: int


class Generation:
    """One request in flight: engine deltas in, ``Piece``s out."""

    def __init__(self, client: EngineClient, stream: RequestStream, tokenizer: Tokenizer,
                 prompt_ids: list[int], params: SamplingParams,
                 resumed: Resumed | None = None, index: int = 0,
                 tokens_as_ids: bool = False) -> None:
        self.client = client
        self.index = index  # which choice of the answer
        self.stream = stream
        self.output = OutputProcessor(tokenizer, prompt_ids, params, tokens_as_ids)
        self.num_prompt_tokens = len(prompt_ids)
        if resumed is not None:
            self.output.resume(resumed.token_ids, resumed.text_chars)
        self.engine_arrival: float | None = None
        self.first_token_received: float | None = None  # when the server read it
        self.timing = RequestTiming(arrival=stream.arrival_time)
        self.done = False
        self.reasoning_tokens: int | None = None
        """Under ``--reasoning-parser``: the thought's tokens, as its reader counts them."""

    async def pieces(self) -> AsyncIterator[P.Piece]:
        """Yields until a piece carries the finish reason; raises ``APIError`` on failure."""
        while not self.done:
            yield self.fold(await self.stream.get())

    def close(self) -> None:
        """Frees the engine's copy if the request is still running (client gone, error)."""
        if not self.stream.finished:
            self.client.abort(self.stream.request_id)
        self.timing.finished = time.monotonic()

    def fold(self, items: Items) -> P.Piece:
        """The piece for these deltas; raises ``APIError`` if the engine failed the request."""
        for delta, step_time in items:
            self._note(delta, step_time)
        # One delta per call is the usual case (a stream that kept up with the engine).
        deltas = [items[0][0]] if len(items) == 1 else [delta for delta, _ in items]
        out = self.output.process(deltas)
        if out.abort:
            self.close()  # the engine never sees stop strings: tell it to stop now
        if out.finish_reason == "error":
            raise P.APIError(500, "the engine failed while running this request")
        self.done = self.output.finished
        self.timing.finish_reason = out.finish_reason
        return P.Piece(out.text, out.token_ids, out.token_texts, out.logprobs,
                       out.finish_reason, items[-1][1], out.top_logprobs, self.index,
                       out.prompt_logprobs)

    def _note(self, delta: RequestUpdate, step_time: float) -> None:
        if delta.engine_arrival_time is not None:
            self.engine_arrival = delta.engine_arrival_time
        if delta.new_token_ids and self.timing.first_token is None:
            self.timing.first_token = step_time
            self.first_token_received = self.client.batch_received
        self.timing.token_times += [step_time] * len(delta.new_token_ids)

    @property
    def num_generated(self) -> int:
        return self.output.num_generated

    def usage(self) -> dict[str, Any]:
        return P.usage(self.num_prompt_tokens, self.num_generated,
                       self.output.num_cached_tokens, self.reasoning_tokens)


@dataclass
class Format:
    """How one endpoint shapes its answers."""

    chat: bool
    request_id: str
    """The answer's id (``cmpl-...``, ``chatcmpl-...``)."""
    model: str
    created: int
    sampling: P.SamplingRequest
    echo: str = ""
    """Completions with ``echo``: the prompt's text, sent before the output."""
    prompt_ids: list[int] = field(default_factory=list)
    prompt_texts: list[str] = field(default_factory=list)
    """Echo with logprobs: each prompt token's text, leading the logprobs' tokens."""

    tools: ToolRequest | None = None
    """Chat with tool calls: the output becomes content and tool calls."""

    with_token_ids: bool = False
    """Internal P/D route: chunks also carry ``pdserve_token_ids`` (the gateway strips them)."""

    reasoning: str | None = None
    """Chat under ``--reasoning-parser``: the thinking goes apart from the content."""
    include_reasoning: bool = True
    engine_id: str = ""
    """The engine's key for the request (``P.answer_ids``); empty: the answer's id."""

    _text_prefix: bytes = b""
    """``data: `` and the chunk's JSON up to its text."""
    _text_suffix: bytes = b""

    @property
    def engine_key(self) -> str:
        return self.engine_id or self.request_id

    def __post_init__(self) -> None:
        # Most chunks differ from each other only in their text: pre-encode everything else.
        head = P.envelope(self.request_id, self.chunk_kind, self.model, self.created, [])
        head_bytes = P.dumps(head)[:-3]  # drop the empty choices' "[]}"
        if self.chat:
            self._text_prefix = head_bytes + b'[{"index":0,"delta":{"content":'
            self._text_suffix = b'},"logprobs":null,"finish_reason":null}]'
        else:
            self._text_prefix = head_bytes + b'[{"index":0,"text":'
            self._text_suffix = b',"logprobs":null,"finish_reason":null}]'
        if self.sampling.include_usage:
            self._text_suffix += b',"usage":null'
        self._text_prefix = b"data: " + self._text_prefix

    def with_echo(self, piece: P.Piece) -> P.Piece:
        """A choice's first piece with the echoed prompt before it (and, with logprobs, the
        prompt's tokens before its tokens)."""
        piece = replace(piece, text=self.echo + piece.text)
        if not self.sampling.echo_logprobs:
            return piece
        return P.echo_logprobs(piece, self.prompt_ids, self.prompt_texts,
                               self.sampling.top_logprobs, self.sampling.tokens_as_ids)

    def _prompt_logprobs(self, piece: P.Piece) -> list | None:
        if self.sampling.prompt_logprobs is None or piece.prompt_logprobs is None:
            return None
        return P.prompt_logprobs_json(piece.prompt_logprobs, self.prompt_ids,
                                      self.sampling.prompt_logprobs)

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def text_chunk(self, text: str, timing: bytes = b"") -> bytes:
        """The SSE event of a chunk with nothing but new text (and optional timing fields)."""
        return b"".join((self._text_prefix, P.dumps_str(text), self._text_suffix, timing,
                         b"}\n\n"))

    def chunk(self, piece: P.Piece, offset: int, first: bool) -> dict[str, Any]:
        logprobs = self.sampling.logprobs
        if self.chat:
            choice = P.chat_choice(piece, logprobs, delta=True)
            if first:
                choice["delta"] = {"role": "assistant", "content": piece.text}
        else:
            choice = P.completion_choice(piece, logprobs, offset)
        return P.envelope(self.request_id, self.chunk_kind, self.model, self.created, [choice],
                          with_usage_key=self.sampling.include_usage)

    def full(self, pieces: list[P.Piece], usage: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choices = [P.chat_choice(p, self.sampling.logprobs, delta=False) for p in pieces]
            for choice in choices if self.reasoning else ():
                _put_reasoning_apart(choice["message"], self.include_reasoning, self.reasoning)
            for choice in choices if self.tools is not None else ():
                self.tools.finish_choice(choice)
            kind = "chat.completion"
        else:
            choices = [P.completion_choice(p, self.sampling.logprobs) for p in pieces]
            kind = "text_completion"
        if self.sampling.prompt_logprobs is not None and not self.chat:
            for choice, piece in zip(choices, pieces, strict=True):
                choice["prompt_logprobs"] = self._prompt_logprobs(piece)
        body = P.envelope(self.request_id, kind, self.model, self.created, choices, usage)
        if self.sampling.prompt_logprobs is not None and self.chat:
            body["prompt_logprobs"] = self._prompt_logprobs(pieces[0])  # vLLM: per response
        return body


class OpenAIServing:
    def __init__(self, client: EngineClient, tokenizer: Tokenizer, model_name: str,
                 metrics: ServerMetrics, log_requests: bool = False,
                 model_aliases: tuple[str, ...] = (),
                 sampling_defaults: dict[str, Any] | None = None,
                 tool_settings: ToolSettings | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.client = client
        self.tool_settings = tool_settings or ToolSettings()
        self.reasoning_parser = reasoning_parser
        self.tokenizer = tokenizer
        if tokenizer is not None:  # the stream's look-up table: built now, not in a request
            tokenizer.piece_table  # noqa: B018
        self.model_name = model_name
        self.model_names = (model_name, *model_aliases)
        # The generation config's fields, used where a request leaves them unset (vLLM's rule).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.metrics = metrics
        self.log_requests = log_requests
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._completions(http, P.parse_json_body(await http.read()))

    async def chat(self, http: web.Request) -> web.StreamResponse:
        return await self._chat(http, P.parse_json_body(await http.read()))

    async def _completions(self, http: web.Request, body: dict) -> web.StreamResponse:
        body = P.with_request_id_header(body, http.headers)
        prepared, default_max_tokens = await self._prepare_completions(self._with_defaults(body))
        if len(prepared) == 1:
            return await self.run(http, *prepared[0], default_max_tokens)
        return await self._run_batch(http, prepared, default_max_tokens)

    async def _chat(self, http: web.Request, body: dict) -> web.StreamResponse:
        body = P.with_request_id_header(body, http.headers)
        return await self.run(http, *await self.prepare("chat", body))

    async def invocations(self, http: web.Request) -> web.StreamResponse:
        """SageMaker's ``/invocations``, as vLLM answers it: a body with ``messages`` is a
        chat completion, one with ``prompt`` a completion."""
        body = P.parse_json_body(await http.read())
        if "messages" in body:
            return await self._chat(http, body)
        if "prompt" in body:
            return await self._completions(http, body)
        raise P.bad_request("/invocations takes a chat completion ('messages') or a "
                            "completion ('prompt') request; this body has neither",
                            param="messages")

    async def prepare(self, kind: str, body: dict) -> tuple[Format, list[int], int | None]:
        """Parses and tokenizes a request of ``kind`` ("completions" or "chat"): its answer
        format, prompt token ids and default max_tokens. Raises ``APIError`` (400)."""
        body = self._with_defaults(body)
        if kind == "completions":
            prepared, default_max_tokens = await self._prepare_completions(body)
            if len(prepared) > 1:
                raise P.bad_request("a batch of prompts is answered only by /v1/completions; "
                                    "send one request per prompt", param="prompt")
            return *prepared[0], default_max_tokens
        if kind == "chat":
            return await self._prepare_chat(body)
        raise P.bad_request(f"unknown request kind {kind!r}; use 'completions' or 'chat'",
                            param="kind")

    def _with_defaults(self, body: dict) -> dict:
        unset = {k: v for k, v in self.sampling_defaults.items()
                 if k != "max_tokens" and body.get(k) is None}
        return {**body, **unset} if isinstance(body, dict) else body

    @property
    def default_max_tokens(self) -> int | None:
        return self.sampling_defaults.get("max_tokens")

    async def _prepare_completions(self, body: dict
                                   ) -> tuple[list[tuple[Format, list[int]]], int]:
        """Each prompt's answer format and token ids (one id and time for all of them), and
        the default max_tokens."""
        request = P.CompletionRequest.parse(body)
        self.check_model(request.sampling.model)
        request.sampling.grammar = read_grammar(body)
        ids, created = P.answer_ids("cmpl", body), P.now_s()
        prepared = [await self._prepare_prompt(request, prompt, ids, created)
                    for prompt in request.prompts]
        return prepared, self.default_max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS

    async def _prepare_prompt(self, request: P.CompletionRequest, prompt: str | list[int],
                              ids: tuple[str, str], created: int) -> tuple[Format, list[int]]:
        if isinstance(prompt, str):
            add_special = request.sampling.add_special_tokens is not False
            prompt_ids = await self.encode(prompt, add_special_tokens=add_special)
        else:
            prompt_ids = prompt
            P.check_token_ids(prompt_ids, self.client.vocab_size)
        prompt_ids, cut = self._checked(prompt_ids, request.sampling)
        fmt = Format(False, ids[0], self.model_name, created, request.sampling,
                     prompt_ids=prompt_ids, engine_id=ids[1])
        skip = request.sampling.skip_special_tokens
        if request.echo:  # the prompt as the model saw it
            fmt.echo = self._prompt_text(prompt_ids if cut else prompt, skip)
        if request.sampling.echo_logprobs and request.sampling.tokens_as_ids:
            fmt.prompt_texts = [token_id_name(t) for t in prompt_ids]
        elif request.sampling.echo_logprobs:
            fmt.prompt_texts = [self.tokenizer.decode([t], skip) for t in prompt_ids]
        return fmt, prompt_ids

    def _checked(self, prompt_ids: list[int], sampling: P.SamplingRequest
                 ) -> tuple[list[int], bool]:
        """Both endpoints, once the prompt is tokenized: the sampling's token ids and
        priority checked, and the prompt's last ``truncate_prompt_tokens`` tokens (as vLLM,
        from the left) with whether any were cut."""
        P.check_sampling_token_ids(sampling, self.client.vocab_size)
        P.check_priority(sampling, self.client.setup.get("prefill_order"))
        keep, context = sampling.truncate_prompt_tokens, self.client.max_model_len
        if keep is None:
            return prompt_ids, False
        keep = context if keep == -1 else keep
        if keep > context:
            raise P.bad_request(f"'truncate_prompt_tokens' ({keep}) exceeds this model's "
                                f"context of {context} tokens", param="truncate_prompt_tokens")
        return prompt_ids[-keep:], len(prompt_ids) > keep

    def _prompt_text(self, prompt: str | list[int], skip_special_tokens: bool) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens)

    async def _prepare_chat(self, body: dict) -> tuple[Format, list[int], int | None]:
        request = P.ChatRequest.parse(body)
        self.check_model(request.sampling.model)
        tools = self._read_tools(body, request.sampling)
        template_kwargs = request.chat_template_kwargs
        if tools is not None:
            template_kwargs = {**template_kwargs, "tools": tools.template_tools}
        text = self.render_chat(request.messages, request.add_generation_prompt,
                                request.continue_final_message, request.chat_template,
                                template_kwargs)
        prompt_ids = await self.encode_chat(text, request.sampling.add_special_tokens)
        prompt_ids, _ = self._checked(prompt_ids, request.sampling)
        # Under a grammar the output is the grammar's from its first token: no thinking.
        reasoning = self.reasoning_parser if request.sampling.grammar is None else None
        answer_id, engine_id = P.answer_ids("chatcmpl", body)
        fmt = Format(True, answer_id, self.model_name, P.now_s(), request.sampling,
                     engine_id=engine_id,
                     tools=tools, prompt_ids=prompt_ids, reasoning=reasoning,
                     include_reasoning=request.include_reasoning)
        last = request.messages[-1]
        if request.echo and last["role"] == "assistant":  # vLLM's rule: same role, echoed
            fmt.echo = last["content"]
        return fmt, prompt_ids, self.default_max_tokens

    def _read_tools(self, body: dict, sampling: P.SamplingRequest) -> ToolRequest | None:
        """The request's tool calling; ``required`` and named choices set its grammar."""
        sampling.grammar = read_grammar(body)
        tools = ToolRequest.read(body, self.tool_settings)
        spec = tools.grammar() if tools is not None else None
        if spec is not None and sampling.grammar is not None:
            raise P.bad_request(f"tool_choice '{tools.choice}' constrains the output, as does "
                                f"'{sampling.grammar.field}'; send one of them",
                                param="tool_choice")
        if spec is not None:
            check(spec)
            sampling.grammar = spec
        return tools

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                    continue_final_message: bool, chat_template: str | None,
                    template_kwargs: dict[str, Any]) -> str:
        """The chat template rendered; raises ``APIError`` (400) for what it refuses."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt, chat_template, **template_kwargs)
        except TemplateSyntaxError as exc:
            raise P.bad_request(f"'chat_template' is not a valid Jinja template: {exc}",
                                param="chat_template") from None
        except Exception as exc:  # noqa: BLE001 - templates raise on messages they refuse
            raise P.bad_request(f"the chat template refused the messages: {exc}",
                                param="messages") from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1]["content"])
        return text

    async def encode_chat(self, text: str, add_special_tokens: bool | None) -> list[int]:
        # By default a template that writes BOS itself must not get a second one.
        if add_special_tokens is None:
            add_special_tokens = not self.tokenizer.starts_with_bos(text)
        return await self.encode(text, add_special_tokens)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise P.bad_request(f"model '{model}' is not served here; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, text,
                                          add_special_tokens)

    async def run(self, http: web.Request, fmt: Format, prompt_ids: list[int],
                   default_max_tokens: int | None, handoff: KVHandoff | None = None,
                   resumed: Resumed | None = None) -> web.StreamResponse:
        """Answers the request; ``handoff``: the prompt was prefilled on another instance;
        ``resumed``: output tokens another instance already sent (the engine runs them as
        prompt, the answer counts them as output)."""
        arrival = time.monotonic()
        if handoff is not None or resumed is not None:
            refuse_split_features(fmt)
        if resumed is not None and resumed.token_ids and fmt.echo:
            # The echo went out with the first token, and the characters the client holds
            # count it: a resumed answer sends the rest of the output, and no second echo.
            resumed = Resumed(resumed.token_ids, max(0, resumed.text_chars - len(fmt.echo)))
            fmt.echo = ""
        done = resumed.token_ids if resumed else []
        params = resumed_params(self.params(fmt, prompt_ids, default_max_tokens), len(done))
        if fmt.sampling.beam_search:
            return await self._beam_search(fmt, prompt_ids, params, arrival)
        if fmt.sampling.num_generated_choices > 1:
            return await self._run_choices(http, fmt, prompt_ids, params, arrival)
        stream = self.client.add(fmt.engine_key, prompt_ids + done, params, arrival, handoff)
        gen = Generation(self.client, stream, self.tokenizer, prompt_ids, params, resumed,
                         tokens_as_ids=fmt.sampling.tokens_as_ids)
        try:
            if fmt.sampling.stream:
                return await self._stream(http, fmt, gen)
            return await self._collect(fmt, gen)
        finally:
            gen.close()
            self.record(fmt, gen)

    def params(self, fmt: Format, prompt_ids: list[int], default_max_tokens: int | None
               ) -> SamplingParams:
        return fmt.sampling.sampling_params(len(prompt_ids), self.client.max_model_len,
                                            default_max_tokens)

    async def _collect(self, fmt: Format, gen: Generation) -> web.Response:
        whole = await _whole(fmt, gen)
        return _json_response(fmt.full([whole], gen.usage()))

    async def _run_choices(self, http: web.Request, fmt: Format, prompt_ids: list[int],
                           params: SamplingParams, arrival: float) -> web.StreamResponse:
        """``n`` / ``best_of`` > 1: one engine request per choice, sharing the prompt."""
        return await self._answer(http, [(fmt, prompt_ids, params)], arrival)

    async def _beam_search(self, fmt: Format, prompt_ids: list[int], params: SamplingParams,
                           arrival: float) -> web.Response:
        """``use_beam_search``: the best ``n`` of ``max(n, best_of)`` beams, as whole
        choices (``pdserve/beam_search.py``)."""
        if fmt.sampling.grammar is not None:
            raise P.bad_request("'use_beam_search' cannot follow a grammar (this tool_choice "
                                "sets one)", param="tool_choice")
        width = fmt.sampling.num_generated_choices
        step = replace(params, max_tokens=1, temperature=0.0, logprobs=True,
                       top_logprobs=2 * width, ignore_eos=True, stop=[], stop_token_ids=[])
        numbers = itertools.count()

        async def next_tokens(beams: list[list[int]]) -> list[list[tuple[int, float]]]:
            return await asyncio.gather(*(next_token(tokens) for tokens in beams))

        async def next_token(tokens: list[int]) -> list[tuple[int, float]]:
            request_id = f"{fmt.engine_key}-beam{next(numbers)}"
            stream = self.client.add(request_id, prompt_ids + tokens, step, arrival)
            try:
                update = (await stream.get())[0][0]
            finally:
                if not stream.finished:  # the client left, or another beam's step failed
                    self.client.abort(request_id)
            if update.finish_reason == "error" or not update.new_logprobs:
                raise P.APIError(500, "the engine failed while running this request")
            return list(update.new_logprobs[0].top)

        beams = await beam_search(next_tokens, width, params.max_tokens,
                                  set(self.tokenizer.eos_token_ids), params.ignore_eos,
                                  fmt.sampling.length_penalty, len(prompt_ids))
        pieces = [fmt.with_echo(self._beam_piece(beam, i, params))
                  for i, beam in enumerate(beams[:fmt.sampling.n])]
        usage = P.usage(len(prompt_ids), sum(len(b.tokens) for b in beams[:fmt.sampling.n]), 0)
        return _json_response(fmt.full(pieces, usage))

    def _beam_piece(self, beam: Beam, index: int, params: SamplingParams) -> P.Piece:
        tokens = beam.tokens[:-1] if beam.finished else beam.tokens  # its EOS is no text
        text = self.tokenizer.decode(tokens, params.skip_special_tokens)
        return P.Piece(text, beam.tokens, [], None, "stop" if beam.finished else "length",
                       index=index)

    async def _run_batch(self, http: web.Request, prepared: list[tuple[Format, list[int]]],
                         default_max_tokens: int) -> web.StreamResponse:
        """A batch of prompts: each prompt's choices, one answer. Every prompt's parameters
        are checked before any starts, so a refused one starts nothing."""
        arrival = time.monotonic()
        jobs = [(fmt, ids, self.params(fmt, ids, default_max_tokens)) for fmt, ids in prepared]
        return await self._answer(http, jobs, arrival)

    async def _answer(self, http: web.Request,
                      jobs: list[tuple[Format, list[int], SamplingParams]],
                      arrival: float) -> web.StreamResponse:
        """Every prompt's choices as one answer, prompt i's numbered after those of the
        prompts before it (as vLLM numbers a batch)."""
        started: list[Generation] = []
        fmts = [fmt for fmt, _, _ in jobs]
        stride = fmts[0].sampling.num_generated_choices
        try:
            opened = await gather_or_cancel(
                self._open_choices(fmt, ids, params, arrival, i * stride, started)
                for i, (fmt, ids, params) in enumerate(jobs))
            if fmts[0].sampling.stream:
                return await self._stream_choices(http, fmts, opened)
            answers = zip(fmts, opened, strict=True)
            bodies = await gather_or_cancel(
                _full_answer(fmt, first, gens, i * fmt.sampling.n)
                for i, (fmt, (first, gens)) in enumerate(answers))
            return _json_response(_merged(bodies))
        finally:
            for gen in started:
                gen.close()
                self.record(fmts[0], gen)

    async def _open_choices(self, fmt: Format, prompt_ids: list[int], params: SamplingParams,
                            arrival: float, first_index: int, started: list[Generation]
                            ) -> tuple[P.Piece, list[Generation]]:
        """Starts a prompt's choices, numbered from ``first_index`` (each also put in
        ``started``): the first, then the others once its first piece came. Returns that
        piece and the choices."""
        head = self._start_choice(fmt, first_index, 0, prompt_ids, params, arrival)
        started.append(head)
        first = head.fold(await head.stream.get())
        # Choice 0's first token means its prompt's full pages are in the prefix cache:
        # started now, the other choices reuse them instead of computing the prompt again.
        rest = [self._start_choice(fmt, first_index + j, j, prompt_ids, params, arrival)
                for j in range(1, fmt.sampling.num_generated_choices)]
        started += rest
        return first, [head, *rest]

    def _start_choice(self, fmt: Format, index: int, choice: int, prompt_ids: list[int],
                      params: SamplingParams, arrival: float) -> Generation:
        # A prompt's choice j draws with seed + j, as vLLM does (a batch's prompts alike);
        # best_of ranks choices by their logprobs.
        seed = None if params.seed is None else params.seed + choice
        ranked = fmt.sampling.best_of > fmt.sampling.n
        params = replace(params, seed=seed, logprobs=params.logprobs or ranked)
        stream = self.client.add(f"{fmt.engine_key}-{index}", prompt_ids, params, arrival)
        return Generation(self.client, stream, self.tokenizer, prompt_ids, params, index=index,
                          tokens_as_ids=fmt.sampling.tokens_as_ids)

    async def _stream_choices(self, http: web.Request, fmts: list[Format],
                              opened: list[tuple[P.Piece, list[Generation]]]
                              ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(http)
        chunks: asyncio.Queue = asyncio.Queue()
        writers, tasks = [], []
        for fmt, (first, gens) in zip(fmts, opened, strict=True):
            for gen in gens:
                writers.append(_SSEWriter(http, response, fmt, gen))
                tasks.append(asyncio.create_task(
                    _pump(writers[-1], chunks, first if gen is gens[0] else None)))
        try:
            await _write_chunks(response, chunks, len(tasks))
            await writers[0].finish(P.summed_usage([_usage(gens) for _, gens in opened]))
        except P.APIError as exc:
            await response.write(P.sse(exc.body()) + P.SSE_DONE)
        finally:
            for task in tasks:
                task.cancel()
        return response

    async def _stream(self, http: web.Request, fmt: Format, gen: Generation
                      ) -> web.StreamResponse:
        pieces = gen.pieces()
        # Awaited before the response starts: a refused request still gets a plain status.
        first = fmt.with_echo(await anext(pieces))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(http)
        writer = _SSEWriter(http, response, fmt, gen)
        try:
            await writer.write(first)
            await writer.follow()
            await writer.finish(gen.usage())
        except P.APIError as exc:
            await response.write(P.sse(exc.body()) + P.SSE_DONE)
        return response

    def record(self, fmt: Format, gen: Generation) -> None:
        self.metrics.observe(gen.timing)
        if self.log_requests:
            t = gen.timing
            ttft = (t.first_token - t.arrival) * 1e3 if t.first_token else float("nan")
            logger.info("%s prompt=%d output=%d ttft=%.1fms e2e=%.1fms finish=%s user=%s",
                        fmt.request_id, gen.num_prompt_tokens, gen.num_generated, ttft,
                        (t.finished - t.arrival) * 1e3, t.finish_reason, fmt.sampling.user)


class _SSEWriter:
    """Writes a generation's pieces as chunks; empty ones are skipped unless they matter.

    After the first chunk the engine client's dispatcher formats and writes every piece
    itself, inside the dispatch of a step (``_push``): no task wake-up per chunk, so a step's
    chunks for all streams cost one pass. The handler wakes only to write what the
    dispatcher could not (a socket with a backlog), to finish, or for an error.

    Those inline writes go to the socket's transport with the HTTP framing added here
    (``_frame``), the bytes aiohttp's writer would produce: its coroutine per write cost as
    much as the formatting of the chunk.
    """

    def __init__(self, http: web.Request, response: web.StreamResponse, fmt: Format,
                 gen: Generation) -> None:
        self.http = http
        self.response = response
        self.fmt = fmt
        self.gen = gen
        self.offset = 0
        self.sent_first = False
        self.timed = fmt.sampling.return_engine_timing
        # Read for every piece: what makes a piece without text worth a chunk, and what
        # keeps a chunk off the pre-encoded text template.
        self._token_chunks = bool(fmt.sampling.logprobs or self.timed or fmt.with_token_ids)
        self._templated = not (fmt.sampling.logprobs or fmt.sampling.continuous_usage
                               or fmt.reasoning)
        self._extras = bool(self.timed or fmt.with_token_ids)  # fields after the choices
        self._backlog: list[bytes] = []  # formatted, for the handler to write
        self._transport: asyncio.Transport | None = None  # set once the headers are out
        self._chunked = False
        self._error: BaseException | None = None  # raised in the handler
        self.tool_stream = ToolStream(fmt.tools) if fmt.tools is not None else None
        self.thinking = ThinkSplitter(fmt.reasoning) if fmt.reasoning else None
        # Text read whole rather than passed on as it comes (a thought split, tool calls):
        # on the P/D route each chunk says how many characters of the model's text it
        # accounts for, and a resumed answer's readers first read what the client holds.
        self._reads_text = self.thinking is not None or self.tool_stream is not None
        self._uncounted = 0  # characters read since the last chunk went out
        self._primed = 0  # characters of a resumed answer's text the readers have read
        # The thought's tokens the failed instance sent: all it sent while the thought
        # still runs; 0 where it ended before the break (that count is lost with it).
        self._resumed_thought = 0

    async def write(self, piece: P.Piece) -> None:
        data = self.encode(piece)
        if data:
            await self.response.write(data)

    def encode(self, piece: P.Piece) -> bytes:
        """The SSE bytes of a piece; b"" for one not worth a chunk."""
        if self._reads_text:
            self._read_resumed_text()
            self._uncounted += len(piece.text)
        if self.tool_stream is not None:
            return self._encode_tools(piece)
        text = piece.text
        if self.sent_first:
            if not (text or piece.finish_reason or (piece.token_ids and self._token_chunks)):
                if self.thinking is not None:  # tokens whose text is held back still count
                    self._think(text, piece)
                return b""
            if self._templated and not (piece.finish_reason or piece.index):
                self.offset += len(text)
                return self.fmt.text_chunk(text, self._extra_bytes(piece) if self._extras
                                           else b"")
        self.offset += len(text)
        chunk = self.fmt.chunk(piece, self.offset - len(piece.text), first=not self.sent_first)
        if self.thinking is not None and not self._split_delta(chunk["choices"][0]["delta"],
                                                               piece) and self.sent_first:
            return b""  # text held back: it may start the end of the thought
        if self.fmt.sampling.continuous_usage:
            chunk["usage"] = self.gen.usage()
        if self.timed:
            self._add_timing(chunk, piece)
        if self.fmt.with_token_ids:
            self._add_resume_fields(chunk, piece)
        self.sent_first = True
        return P.sse(chunk)

    def _add_resume_fields(self, chunk: dict[str, Any], piece: P.Piece) -> None:
        """What the P/D route's gateway needs to resume this answer elsewhere (and strips)."""
        chunk["pdserve_token_ids"] = piece.token_ids
        if self._reads_text:
            # The gateway counts the characters the client got; here the deltas' text is
            # not the model's (a thought apart, tool calls): the count is the model's own.
            chunk["pdserve_text_chars"], self._uncounted = self._uncounted, 0
        if piece.finish_reason and self.fmt.sampling.include_usage \
                and self.fmt.sampling.num_generated_choices == 1:
            # The usage this answer ends with: the gateway sends it if this instance fails
            # between its last token and its usage chunk.
            chunk["pdserve_usage"] = self.gen.usage()

    def _read_resumed_text(self) -> None:
        """A resumed P/D answer: its readers go on from where the failed instance's
        stopped, so they first read the text the client holds (which may grow as the
        coming text's first characters turn out to be held already); what they would send
        for it went out before."""
        held = self.gen.output.resumed_text if self.gen is not None else ""
        if len(held) <= self._primed:
            return
        text, self._primed = held[self._primed:], len(held)
        if self.thinking is not None:
            _, text = self.thinking.push(text)
            in_thought = self.thinking.in_thought
            self._resumed_thought = self.gen.output.resumed_tokens if in_thought else 0
        if self.tool_stream is not None:
            self.tool_stream.push(text, None)

    def _think(self, text: str, piece: P.Piece) -> tuple[str, str]:
        """A piece's text as (reasoning, content), its tokens counted with the thought's
        while it is all thought."""
        split = self.thinking.push(text, bool(piece.finish_reason), len(piece.token_ids))
        if self.gen is not None:
            self.gen.reasoning_tokens = self._resumed_thought + self.thinking.thought_tokens
        return split

    def _split_delta(self, delta: dict[str, Any], piece: P.Piece) -> bool:
        """Puts a chat delta's reasoning apart from its content; whether it still says
        anything."""
        reasoning, content = self._think(piece.text, piece)
        delta.pop("content", None)
        if content:
            delta["content"] = content
        if reasoning and self.fmt.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        return bool(content or "reasoning" in delta or piece.finish_reason
                    or (piece.token_ids and self._token_chunks))

    def _encode_tools(self, piece: P.Piece) -> bytes:
        """A piece of a chat with tools: content and tool-call deltas, a chunk each (the
        reasoning first, under ``--reasoning-parser``: the calls are read in the content)."""
        text, reasoning = piece.text, ""
        if self.thinking is not None:
            reasoning, text = self._think(text, piece)
        deltas, finish = self.tool_stream.push(text, piece.finish_reason)
        if reasoning and self.fmt.include_reasoning:
            deltas = [{"reasoning": reasoning, "reasoning_content": reasoning}, *deltas]
        wants_chunk = finish or (piece.token_ids and self._token_chunks)
        if not deltas and (self.sent_first and not wants_chunk):
            return b""
        deltas = deltas or [{}]
        if not self.sent_first:
            deltas[0] = {"role": "assistant", **deltas[0]}
        self.sent_first = True
        logprobs = P.chat_logprobs(piece) if self.fmt.sampling.logprobs else None
        choices = [{"index": piece.index, "delta": delta,
                    "logprobs": logprobs if i == 0 else None,
                    "finish_reason": finish if i == len(deltas) - 1 else None}
                   for i, delta in enumerate(deltas)]
        usage = self.gen.usage() if self.fmt.sampling.continuous_usage else None
        chunks = [P.envelope(self.fmt.request_id, self.fmt.chunk_kind, self.fmt.model,
                             self.fmt.created, [choice], usage,
                             with_usage_key=self.fmt.sampling.include_usage)
                  for choice in choices]
        if self.fmt.with_token_ids:
            for chunk in chunks[:-1]:
                chunk["pdserve_text_chars"] = 0  # the piece's count goes with its last
            self._add_resume_fields(chunks[-1], piece)
        return b"".join(P.sse(chunk) for chunk in chunks)

    async def follow(self) -> None:
        """Until the generation is done, with the dispatcher writing the pieces. Called
        once the first chunk is written (a first piece always makes one)."""
        stream = self.gen.stream
        # aiohttp sent the headers with that chunk; what follows may bypass its writer.
        self._transport = self.http.transport
        self._chunked = self.response.headers.get("Transfer-Encoding") == "chunked"
        stream.listener = self._push
        try:
            while True:
                items = stream.take()  # arrived before the listener was set
                if items:
                    self._backlog.append(self.encode(self.gen.fold(items)))
                await self._flush()
                if self._error is not None:
                    raise self._error
                if self.gen.done:
                    return
                await stream.wait()
        finally:
            stream.listener = None

    def _push(self, items: Items) -> None:
        """The listener: runs inside the engine client's dispatch, never waits."""
        if self.gen.done:
            return  # tokens past a stop string, sent before the engine saw the abort
        try:
            data = self.encode(self.gen.fold(items))
            if data:
                if not self._backlog and self._has_room(len(data)):
                    self._transport.write(self._frame(data))
                else:
                    self._backlog.append(data)
        except (P.APIError, ConnectionError) as exc:
            self._error = exc
        if self._backlog or self._error is not None or self.gen.done:
            self.gen.stream.wake()

    def _has_room(self, size: int) -> bool:
        transport = self._transport
        return (transport is not None and not transport.is_closing()
                and transport.get_write_buffer_size() + size <= INLINE_WRITE_LIMIT)

    def _frame(self, data: bytes) -> bytes:
        """``data`` as aiohttp writes it: a chunk of the chunked encoding (HTTP/1.1), or as
        it is (HTTP/1.0, where the end of the connection ends the body)."""
        return b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data

    async def _flush(self) -> None:
        while self._backlog:
            data = b"".join(self._backlog)
            self._backlog.clear()
            await self.response.write(data)

    def _extra_bytes(self, piece: P.Piece) -> bytes:
        """The optional fields a templated chunk carries after its choices."""
        timing = self._timing_bytes(piece) if self.timed else b""
        return timing + self._token_id_bytes(piece) if self.fmt.with_token_ids else timing

    def _token_id_bytes(self, piece: P.Piece) -> bytes:
        if not self.fmt.with_token_ids:
            return b""
        return b',"pdserve_token_ids":[' + ",".join(map(str, piece.token_ids)).encode() + b"]"

    @staticmethod
    def _timing_bytes(piece: P.Piece) -> bytes:
        return b',"engine_time":%r,"num_tokens":%d' % (piece.engine_time, len(piece.token_ids))

    def _add_timing(self, chunk: dict[str, Any], piece: P.Piece) -> None:
        # Extension read by benchmarks/bench_server_overhead.py: engine-side clock values.
        chunk["engine_time"] = piece.engine_time
        chunk["num_tokens"] = len(piece.token_ids)
        if not self.sent_first:
            chunk["engine_arrival_time"] = self.gen.engine_arrival
            chunk["server_arrival_time"] = self.gen.timing.arrival
            chunk["server_first_token_time"] = self.gen.first_token_received

    async def finish(self, usage: dict[str, Any]) -> None:
        tail = b""
        if self.fmt.sampling.include_usage:
            usage_chunk = P.envelope(self.fmt.request_id, self.fmt.chunk_kind, self.fmt.model,
                                     self.fmt.created, [], usage)
            tail = P.sse(usage_chunk)
        await self.response.write(tail + P.SSE_DONE)
        await self.response.write_eof()


async def _whole(fmt: Format, gen: Generation, first: P.Piece | None = None) -> P.Piece:
    """A generation's whole output as one piece (the echo first)."""
    pieces = [first] if first is not None else []
    pieces += [piece async for piece in gen.pieces()]
    if fmt.reasoning:
        gen.reasoning_tokens = _thought_tokens(pieces, fmt.reasoning)
    pieces[0] = fmt.with_echo(pieces[0])
    tops = [p.top_logprobs for p in pieces if p.top_logprobs is not None]
    return P.Piece("".join(p.text for p in pieces), [],
                   [t for p in pieces for t in p.token_texts],
                   [lp for p in pieces for lp in p.logprobs or []], pieces[-1].finish_reason,
                   top_logprobs=[t for top in tops for t in top] if tops else None,
                   index=gen.index, prompt_logprobs=pieces[0].prompt_logprobs)


def _thought_tokens(pieces: list[P.Piece], parser: str) -> int:
    """The tokens of a whole answer's thought, counted as its stream would count them."""
    thinking = ThinkSplitter(parser)
    for piece in pieces:
        thinking.push(piece.text, piece is pieces[-1], len(piece.token_ids))
    return thinking.thought_tokens


def _best(wholes: list[P.Piece], n: int, first_index: int = 0) -> list[P.Piece]:
    """The ``n`` choices with the highest sum of token logprobs (all of them when there are
    ``n``), numbered from ``first_index`` in that order."""
    if len(wholes) == n:
        return wholes
    # Echoed prompt tokens lead with None (the first has no logprob): the prompt is the same
    # in every choice, so only the generated tokens rank them.
    best = sorted(wholes, key=lambda p: sum(lp for lp in p.logprobs or [] if lp is not None),
                  reverse=True)[:n]
    return [replace(piece, index=first_index + i) for i, piece in enumerate(best)]


async def _full_answer(fmt: Format, first: P.Piece, gens: list[Generation],
                       first_index: int) -> dict[str, Any]:
    """One prompt's whole answer: its best ``n`` choices numbered from ``first_index``."""
    wholes = await asyncio.gather(_whole(fmt, gens[0], first),
                                  *(_whole(fmt, g) for g in gens[1:]))
    return fmt.full(_best(list(wholes), fmt.sampling.n, first_index), _usage(gens))


def _merged(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch's answers as one: every prompt's choices in order, their usage summed."""
    body = bodies[0]
    body["choices"] = [choice for b in bodies for choice in b["choices"]]
    body["usage"] = P.summed_usage([b["usage"] for b in bodies])
    return body


def _usage(gens: list[Generation]) -> dict[str, Any]:
    # The prompt counts once (the choices share it); every generated token counts, those of
    # best_of choices not returned included: they were computed.
    thoughts = [g.reasoning_tokens for g in gens]
    return P.usage(gens[0].num_prompt_tokens, sum(g.num_generated for g in gens),
                   gens[0].output.num_cached_tokens,
                   None if None in thoughts else sum(thoughts))


async def _pump(writer: _SSEWriter, chunks: asyncio.Queue, first: P.Piece | None) -> None:
    """One choice's chunks into the shared queue; None when it is done (or an error)."""
    try:
        if first is not None:
            chunks.put_nowait(writer.encode(writer.fmt.with_echo(first)))
        async for piece in writer.gen.pieces():
            if not writer.sent_first:
                piece = writer.fmt.with_echo(piece)
            chunks.put_nowait(writer.encode(piece))
    except P.APIError as exc:
        chunks.put_nowait(exc)
    finally:
        chunks.put_nowait(None)


async def _write_chunks(response: web.StreamResponse, chunks: asyncio.Queue, sources: int
                        ) -> None:
    while sources:
        item = await chunks.get()
        if item is None:
            sources -= 1
        elif isinstance(item, P.APIError):
            raise item
        elif item:
            await response.write(item)


def refuse_split_features(fmt: Format) -> None:
    """What a request split between a prefill and a decode instance cannot do: several
    choices (one hand-off each), and the first token's alternatives (only its logprob
    crosses)."""
    sampling = fmt.sampling
    if sampling.beam_search:
        raise P.bad_request("'use_beam_search' is not supported when prefill and decode run "
                            "on different instances", param="use_beam_search")
    if sampling.num_generated_choices > 1:
        name = "n" if sampling.n > 1 else "best_of"
        raise P.bad_request(f"'{name}' > 1 is not supported when prefill and decode run on "
                            "different instances", param=name)
    if sampling.top_logprobs:
        name = "top_logprobs" if fmt.chat else "logprobs"
        raise P.bad_request("top alternatives are not returned when prefill and decode run "
                            "on different instances", param=name)
    if sampling.scored_prompt_width is not None:
        name = "prompt_logprobs" if sampling.prompt_logprobs is not None else "echo"
        raise P.bad_request(f"'{name}' needs the prompt's logprobs, which are not returned "
                            "when prefill and decode run on different instances", param=name)


def resumed_params(params: SamplingParams, done: int) -> SamplingParams:
    """The sampling left for an answer whose first ``done`` tokens are already out."""
    if not done:
        return params
    if params.grammar is not None:
        # The resumed tokens reach the engine as prompt, so a new matcher would start the
        # grammar over in the middle of the output.
        raise P.bad_request("output constrained by a grammar cannot be resumed on another "
                            "instance", param=params.grammar.field)
    if done >= params.max_tokens:
        raise P.bad_request(f"{done} resumed tokens leave nothing of max_tokens "
                            f"({params.max_tokens}) to generate", param="resume_token_ids")
    return replace(params, max_tokens=params.max_tokens - done,
                   min_tokens=max(0, params.min_tokens - done))


def _cut_after_final_message(text: str, content: str) -> str:
    """The prompt ends inside the last message, so the model continues it."""
    end = text.rfind(content) if content else -1
    if end < 0:
        raise P.bad_request("'continue_final_message': the rendered template does not contain "
                            "the last message's content", param="continue_final_message")
    return text[:end + len(content)]


def _put_reasoning_apart(message: dict[str, Any], include: bool, parser: str) -> None:
    """A whole chat message's reasoning out of its content (``--reasoning-parser``)."""
    reasoning, content = split_reasoning(message.get("content") or "", parser)
    message["content"] = content or None
    if include:
        message["reasoning"] = message["reasoning_content"] = reasoning or None


def _json_response(body: dict[str, Any]) -> web.Response:
    return web.Response(body=P.dumps(body), content_type="application/json")
