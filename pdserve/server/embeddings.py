"""``POST /v1/embeddings``, with OpenAI's and vLLM's request and response shapes, and
vLLM's ``/score`` and ``/rerank`` on top of them (the cosine similarity of two embeddings,
as vLLM scores with an embedding model).

The served model's own embeddings: the last hidden state (after the final norm) at each
input's last token, L2-normalized - last-token pooling, as decoder models trained as
embedders (E5-Mistral, GTE-Qwen, Qwen3-Embedding) are pooled. Each input is one engine
request of one token (``SamplingParams.return_embedding``; the token is thrown away),
scheduled, batched and prefix-cached as any prompt. A generative checkpoint answers too,
with embeddings it was never trained for: which checkpoint to serve is the user's choice.

``input``: a string, a list of token ids, or a list of either (one embedding each, in
order); ``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32, as
OpenAI's); ``truncate_prompt_tokens`` (vLLM's) keeps each input's last N tokens (-1: as
many as the model takes); ``add_special_tokens`` (default true) as on completions.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from aiohttp import web

from pdserve.sampling_params import SamplingParams
from pdserve.server import protocol as P
from pdserve.server.serving import Generation, OpenAIServing

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs
EMBEDDING_FIELDS: dict[str, P.FieldRule] = {
    **dict.fromkeys(("model", "input", "encoding_format", "user", "truncate_prompt_tokens",
                     "add_special_tokens", "priority"), P.HONOURED),
    "dimensions": P.Refused("the model's embeddings have one size (no Matryoshka "
                            "representation to cut)"),
}
"""``/v1/embeddings``: every field it takes; any other is refused with 400."""
_PAIR_FIELDS = dict.fromkeys(("model", "user", "truncate_prompt_tokens", "priority"),
                             P.HONOURED)
SCORE_FIELDS: dict[str, P.FieldRule] = {**_PAIR_FIELDS, "text_1": P.HONOURED,
                                        "text_2": P.HONOURED}
RERANK_FIELDS: dict[str, P.FieldRule] = {
    **_PAIR_FIELDS, **dict.fromkeys(("query", "documents", "top_n", "return_documents"),
                                    P.HONOURED)}


class EmbeddingRoutes:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
        for path in P.SCORE_PATHS:
            app.router.add_post(path, self.score)
        for path in P.RERANK_PATHS:
            app.router.add_post(path, self.rerank)

    async def embeddings(self, http: web.Request) -> web.Response:
        body = P.parse_json_body(await http.read())
        P.check_fields(body, EMBEDDING_FIELDS, "/v1/embeddings")
        encoding = P.get_str(body, "encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise P.bad_request("'encoding_format' must be 'float' or 'base64'",
                                param="encoding_format")
        vectors, tokens = await self.embed([("input", read_inputs(body.get("input")))], body)
        data = [{"object": "embedding", "index": i, "embedding": encoded(v, encoding)}
                for i, v in enumerate(vectors)]
        answer = {"id": P.new_id("embd"), "object": "list", "created": P.now_s(),
                  "model": self._model(body), "data": data,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return _json(answer)

    async def score(self, http: web.Request) -> web.Response:
        """vLLM's ``/score``: ``text_1`` against each ``text_2`` (one against many, or
        pairwise between two lists of one length)."""
        body = P.parse_json_body(await http.read())
        P.check_fields(body, SCORE_FIELDS, "/score")
        first, second = _texts(body, "text_1"), _texts(body, "text_2")
        if len(first) != 1 and len(first) != len(second):
            raise P.bad_request(f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: "
                                "give one text_1, or as many as text_2", param="text_1")
        vectors, tokens = await self.embed([("text_1", first), ("text_2", second)], body)
        left, right = vectors[:len(first)], vectors[len(first):]
        scores = [_cosine(left[0 if len(left) == 1 else i], v) for i, v in enumerate(right)]
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        answer = {"id": P.new_id("score"), "object": "list", "created": P.now_s(),
                  "model": self._model(body), "data": data,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return _json(answer)

    async def rerank(self, http: web.Request) -> web.Response:
        """vLLM's ``/rerank`` (Jina's and Cohere's shape): the documents by their score
        against the query, best first, the ``top_n`` best (default all)."""
        body = P.parse_json_body(await http.read())
        P.check_fields(body, RERANK_FIELDS, "/rerank")
        query = P.get_str(body, "query")
        if not query:
            raise P.bad_request("'query' must be a non-empty string", param="query")
        documents = _texts(body, "documents")
        top_n = P.get_int(body, "top_n") or len(documents)
        if top_n < 0:
            raise P.bad_request("'top_n' must be >= 0", param="top_n")
        vectors, tokens = await self.embed([("query", [query]), ("documents", documents)], body)
        ranked = sorted(((_cosine(vectors[0], v), i) for i, v in enumerate(vectors[1:])),
                        key=lambda pair: (-pair[0], pair[1]))[:top_n]
        keep = P.get_bool(body, "return_documents", True)
        results = [{"index": i, "relevance_score": s,
                    **({"document": {"text": documents[i]}} if keep else {})}
                   for s, i in ranked]
        return _json({"id": P.new_id("rerank"), "model": self._model(body),
                      "usage": {"total_tokens": tokens}, "results": results})

    async def embed(self, fields: list[tuple[str, list[str | list[int]]]], body: dict
                    ) -> tuple[list[list[float]], int]:
        """The embeddings of every field's items, in order, and their tokens; ``body``'s
        model, truncation, special tokens and priority; an item that cannot run is a 400
        naming its field and its place in it."""
        self.serving.check_model(P.get_str(body, "model"))
        prompts = [await self._prompt_ids(item, body, f"{param}[{i}]", param)
                   for param, items in fields for i, item in enumerate(items)]
        params = SamplingParams(max_tokens=1, temperature=0, return_embedding=True,
                                priority=P.get_int(body, "priority", 0))
        return await self._embed_all(prompts, params), sum(len(p) for p in prompts)

    def _model(self, body: dict) -> str:
        return P.get_str(body, "model") or self.serving.model_name

    async def _prompt_ids(self, item: str | list[int], body: dict, name: str, param: str
                          ) -> list[int]:
        """One input's token ids, truncated as asked and checked against the model."""
        ids = item if isinstance(item, list) else await self.serving.encode(
            item, P.get_bool(body, "add_special_tokens", True))
        limit = self.serving.client.max_model_len
        keep = P.get_int(body, "truncate_prompt_tokens")
        if keep is not None:
            if keep != -1 and keep < 1:
                raise P.bad_request("'truncate_prompt_tokens' must be -1 or >= 1",
                                    param="truncate_prompt_tokens")
            ids = ids[-(limit if keep == -1 else keep):]
        if not ids:
            raise P.bad_request(f"{name} has no tokens", param=param)
        vocab = self.serving.client.vocab_size
        if vocab is not None and max(ids) >= vocab:
            raise P.bad_request(f"{name}: token ids must be below the vocabulary "
                                f"size {vocab}", param=param)
        if len(ids) > limit:
            raise P.bad_request(f"{name} has {len(ids)} tokens; this model's maximum "
                                f"context length is {limit} (truncate_prompt_tokens cuts it)",
                                param=param)
        return ids

    async def _embed_all(self, prompts: list[list[int]], params: SamplingParams
                         ) -> list[list[float]]:
        """Every input at once, each its own engine request; any failure ends them all."""
        arrival = time.monotonic()
        request_id = P.new_id("embd")
        gens = [Generation(self.serving.client,
                           self.serving.client.add(f"{request_id}-{i}", ids, params, arrival),
                           self.serving.tokenizer, ids, params)
                for i, ids in enumerate(prompts)]
        try:
            return await asyncio.gather(*(_embedding(gen) for gen in gens))
        finally:
            for gen in gens:
                gen.close()
                self._record(gen)

    def _record(self, gen: Generation) -> None:
        """An input in the request histograms as vLLM counts a pooling request: its time to
        the embedding as its TTFT, finished as ``stop`` (its one sampled token, thrown away,
        is not a ``length``); one that failed or was cut short keeps its reason."""
        if gen.output.embedding is not None:
            gen.timing.finish_reason = "stop"
        self.serving.metrics.observe(gen.timing)


async def _embedding(gen: Generation) -> list[float]:
    async for _ in gen.pieces():
        pass
    if gen.output.embedding is None:  # finished without its first token (never expected)
        raise P.APIError(500, "the engine ended the input without its embedding")
    return gen.output.embedding


def read_inputs(value: Any) -> list[str | list[int]]:
    """``input`` as its inputs, read as a completion's ``prompt`` (``P.read_prompts``), at
    most ``MAX_INPUTS`` of them."""
    items = P.read_prompts(value, "input")
    if len(items) > MAX_INPUTS:
        raise P.bad_request(f"at most {MAX_INPUTS} inputs per request", param="input")
    return items


def _texts(body: dict, name: str) -> list[str]:
    """A field that holds one non-empty string or a non-empty list of them."""
    value = body.get(name)
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(
            isinstance(t, str) and t for t in texts):
        raise P.bad_request(f"'{name}' must be a non-empty string or a list of them",
                            param=name)
    if len(texts) > MAX_INPUTS:
        raise P.bad_request(f"at most {MAX_INPUTS} texts in '{name}'", param=name)
    return texts


def _cosine(a: list[float], b: list[float]) -> float:
    """Of two L2-normalized embeddings: their dot product."""
    return float(np.dot(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)))


def _json(body: dict) -> web.Response:
    return web.Response(body=P.dumps(body), content_type="application/json")


def encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
