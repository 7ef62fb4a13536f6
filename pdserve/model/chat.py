"""Chat messages as a chat template reads them; no template engine imported here, so the
server's protocol (and the gateway through it) can use it."""

from __future__ import annotations

from typing import Any


def message_text(content: Any) -> str:
    """A message's content as text: a string, or text parts joined (OpenAI's two forms);
    raises ``ValueError`` for anything else (images, audio, ...)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ValueError("only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError("must be a string or a list of text parts")
