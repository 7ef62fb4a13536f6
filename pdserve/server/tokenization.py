"""``/tokenize``, ``/detokenize`` and ``/version``, with vLLM's request and response shapes.

- ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": true}`` or
  ``{"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
  "chat_template": ..., "chat_template_kwargs": ..., "add_special_tokens": ...}``, both
  with an optional ``model`` and ``return_token_strs``; answers
  ``{"count", "max_model_len", "tokens", "token_strs"}`` with exactly the ids that
  ``/v1/completions`` or ``/v1/chat/completions`` would send to the engine.
- ``POST /detokenize`` ``{"tokens": [int, ...]}`` answers ``{"prompt": str}``.
- ``GET /version`` answers ``{"version": str}``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

import pdserve
from pdserve.server import protocol as P
from pdserve.server.serving import OpenAIServing
from pdserve.server.tool_calls import template_tools

_COMMON = {"model": P.HONOURED, "add_special_tokens": P.HONOURED,
           "return_token_strs": P.HONOURED}
TOKENIZE_PROMPT_FIELDS: dict[str, P.FieldRule] = {**_COMMON, "prompt": P.HONOURED}
TOKENIZE_CHAT_FIELDS: dict[str, P.FieldRule] = {
    **_COMMON, **dict.fromkeys(("messages", "add_generation_prompt", "continue_final_message",
                                "chat_template", "chat_template_kwargs", "documents", "tools",
                                "tool_choice"), P.HONOURED),
}
DETOKENIZE_FIELDS: dict[str, P.FieldRule] = {"model": P.HONOURED, "tokens": P.HONOURED}


class TokenizationRoutes:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", version)

    async def tokenize(self, http: web.Request) -> web.Response:
        body = P.parse_json_body(await http.read())
        if "messages" in body:
            tokens = await self._chat_tokens(body)
        else:
            tokens = await self._prompt_tokens(body)
        answer: dict[str, Any] = {"count": len(tokens),
                                  "max_model_len": self.serving.client.max_model_len,
                                  "tokens": tokens, "token_strs": None}
        if P.get_bool(body, "return_token_strs"):
            decode = self.serving.tokenizer.decode
            answer["token_strs"] = [decode([t], False) for t in tokens]
        return _json(answer)

    async def _prompt_tokens(self, body: dict) -> list[int]:
        P.check_fields(body, TOKENIZE_PROMPT_FIELDS, "/tokenize")
        self.serving.check_model(P.get_str(body, "model"))
        prompt = P.get_str(body, "prompt")
        if prompt is None:
            raise P.bad_request("'prompt' (a string) or 'messages' is required", param="prompt")
        return await self.serving.encode(prompt, P.get_bool(body, "add_special_tokens", True))

    async def _chat_tokens(self, body: dict) -> list[int]:
        P.check_fields(body, TOKENIZE_CHAT_FIELDS, "/tokenize")
        self.serving.check_model(P.get_str(body, "model"))
        options = P.read_template_options(body)
        variables = options["chat_template_kwargs"]
        tools = template_tools(body)  # as the chat would show them to the template
        if tools is not None:
            variables = {**variables, "tools": tools}
        text = self.serving.render_chat(P.read_messages(body.get("messages")),
                                        options["add_generation_prompt"],
                                        options["continue_final_message"],
                                        options["chat_template"], variables)
        add_special = body.get("add_special_tokens")
        return await self.serving.encode_chat(
            text, None if add_special is None else P.get_bool(body, "add_special_tokens"))

    async def detokenize(self, http: web.Request) -> web.Response:
        body = P.parse_json_body(await http.read())
        P.check_fields(body, DETOKENIZE_FIELDS, "/detokenize")
        self.serving.check_model(P.get_str(body, "model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(P.is_int(t) and t >= 0 for t in tokens):
            raise P.bad_request("'tokens' must be a list of token ids", param="tokens")
        P.check_token_ids(tokens, self.serving.client.vocab_size, param="tokens")
        return _json({"prompt": self.serving.tokenizer.decode(tokens)})


async def version(http: web.Request) -> web.Response:
    return _json({"version": pdserve.__version__})


def _json(body: dict[str, Any]) -> web.Response:
    return web.Response(body=P.dumps(body), content_type="application/json")
