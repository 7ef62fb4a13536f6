"""The offline API, shaped like vLLM's: ``LLM(model, ...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.setup import EngineSetup
from pdserve.messages import RequestUpdate
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
