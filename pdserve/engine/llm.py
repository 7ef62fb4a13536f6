"""The offline API, shaped like vLLM's: ``LLM(model, ...).generate(prompts, params)``,
``.chat(conversations, params)`` and ``.beam_search(prompts, BeamSearchParams(...))``."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.beam_search import Beam, BeamSearchParams, beam_search
from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.setup import EngineSetup
from pdserve.messages import RequestUpdate
from pdserve.model.chat import message_text
from pdserve.model.hub import resolve_model_config
from pdserve.output import OutputProcessor, PromptLogprobs
from pdserve.sampling_params import InvalidRequestError, SamplingParams

Prompt = str | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None


@dataclass
class BeamSearchSequence:
    token_ids: list[int]
    """The generated tokens (an end-of-sequence token included where it ended so)."""
    text: str
    cum_logprob: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
    """Best first."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s answer for one prompt, shaped as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    """With ``SamplingParams.prompt_logprobs``: per prompt token (None for the first), the
    token and the most likely ones at its position, as vLLM gives them."""
    embedding: list[float] | None = None
    """With ``SamplingParams.return_embedding``: the prompt's embedding."""


class LLM:
    """Runs the engine in this process; ``generate`` blocks until every prompt is done."""

    def __init__(self, model: str = "tiny", setup: EngineSetup | None = None,
                 **engine_options: Any):
        """``setup``: parts handed to the engine instead of built (``EngineSetup``)."""
        config = EngineConfig.from_flat(model=model, **engine_options)
        # A hub id becomes its local snapshot (downloaded once) before the engine reads it.
        self.config = replace(config, model=resolve_model_config(config.model))
        self.engine = EngineCore(self.config, setup)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's background work: KV transfer threads and, under tensor
        parallelism, the worker processes (otherwise they go when this object does)."""
        self.engine.close()

    def reset_prefix_cache(self) -> dict:
        """Forgets every cached prompt block no request holds (``EngineCore.reset_prefix_cache``:
        the counts); runs between ``generate`` calls, where nothing is running."""
        return self.engine.reset_prefix_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        pending = [self._submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
        by_id = {out.request_id: (out, processor) for out, processor in pending}
        progress = _progress(len(pending), use_tqdm)
        while any(not out.finished for out, _ in pending):
            for update in self.engine.step():
                if self._apply(update, *by_id[update.request_id]):
                    progress.update(1)
        progress.close()
        return [out for out, _ in pending]

    def embed(self, prompts: Prompt | list[Prompt], use_tqdm: bool = False
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (``SamplingParams.return_embedding``: its last token's
        final hidden state, L2-normalized), as ``/v1/embeddings`` gives it."""
        params = SamplingParams(max_tokens=1, temperature=0, return_embedding=True)
        outputs = self.generate(prompts, params, use_tqdm)
        return [EmbeddingRequestOutput(out.request_id, out.prompt_token_ids,
                                       EmbeddingOutput(out.embedding)) for out in outputs]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """``generate`` on conversations rendered by the chat template, as vLLM's
        ``LLM.chat``: one conversation (a list of messages) or a list of them; each
        ``RequestOutput.prompt`` is the rendered text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) \
            else list(messages)
        prompts = [self._chat_prompt(c, chat_template, add_generation_prompt,
                                     chat_template_kwargs or {}) for c in conversations]
        outputs = self.generate([{"prompt_token_ids": ids} for _, ids in prompts],
                                sampling_params, use_tqdm)
        for out, (text, _) in zip(outputs, prompts, strict=True):
            out.prompt = text
        return outputs

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams
                    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt, the ``beam_width`` best sequences
        (``pdserve/beam_search.py``), each step of every beam one ``generate`` batch."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return [asyncio.run(self._beams(self._tokenize(p)[1], params)) for p in prompts]

    async def _beams(self, prompt_ids: list[int], params: BeamSearchParams
                     ) -> BeamSearchOutput:
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True,
                              top_logprobs=2 * params.beam_width, ignore_eos=True)

        async def next_tokens(beams: list[list[int]]) -> list[list[tuple[int, float]]]:
            outputs = self.generate([{"prompt_token_ids": prompt_ids + b} for b in beams], step)
            return [list(out.outputs[0].logprobs[0].top) for out in outputs]

        beams = await beam_search(next_tokens, params.beam_width, params.max_tokens,
                                  set(self.engine.eos_token_ids), params.ignore_eos,
                                  params.length_penalty, len(prompt_ids))
        return BeamSearchOutput(prompt_ids, [self._sequence(b) for b in beams])

    def _sequence(self, beam: Beam) -> BeamSearchSequence:
        text = self.tokenizer.decode(beam.tokens[:-1] if beam.finished else beam.tokens)
        return BeamSearchSequence(beam.tokens, text, beam.logprob,
                                  "stop" if beam.finished else "length")

    def _chat_prompt(self, messages: list[dict[str, Any]], chat_template: str | None,
                     add_generation_prompt: bool, template_kwargs: dict[str, Any]
                     ) -> tuple[str, list[int]]:
        """A conversation as the server renders it: text content (a string, or text parts
        joined), and BOS only where the template did not write it."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("a conversation is a list of {'role', 'content'} dicts")
        try:
            messages = [{**m, "content": message_text(m.get("content"))} for m in messages]
        except ValueError as exc:
            raise InvalidRequestError(f"a message's content: {exc}") from None
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                  chat_template, **template_kwargs)
        bos = not self.tokenizer.starts_with_bos(text)
        return text, self.tokenizer.encode(text, add_special_tokens=bos)

    def _submit(self, prompt: Prompt, params: SamplingParams):
        text, token_ids = self._tokenize(prompt)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, token_ids, params)
        processor = OutputProcessor(self.tokenizer, token_ids, params)
        completion = CompletionOutput(0, "", [], [] if params.logprobs else None, None)
        return RequestOutput(request_id, text, token_ids, [completion]), processor

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidRequestError("a prompt is a string, {'prompt': str} or "
                                  "{'prompt_token_ids': [int, ...]}")

    def _apply(self, update: RequestUpdate, out: RequestOutput,
               processor: OutputProcessor) -> bool:
        """Folds one update into the output; True when the request just finished."""
        if out.finished:  # an update sent before the engine saw a stop string's abort
            return False
        delta = processor.process([update])
        completion = out.outputs[0]
        completion.text += delta.text
        completion.token_ids += delta.token_ids
        if completion.logprobs is not None:
            completion.logprobs += delta.logprobs or []
        out.num_cached_tokens = processor.num_cached_tokens
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if processor.embedding is not None:
            out.embedding = processor.embedding
        if delta.abort:
            self.engine.abort_request(out.request_id)
        completion.finish_reason = delta.finish_reason
        out.finished = processor.finished
        return out.finished


def _broadcast(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise InvalidRequestError(f"{len(params)} sampling params for {count} prompts")
    return list(params)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", disable=not enabled)
