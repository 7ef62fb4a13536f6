"""Reasoning outputs (``--reasoning-parser``, as vLLM's): a reasoning model's thinking goes
in the chat answer's ``reasoning`` (and ``reasoning_content``, the name vLLM used first and
SGLang and DeepSeek's API use), the rest in ``content``.

``deepseek_r1`` (DeepSeek-R1's Qwen2 and Llama distills, QwQ): the thinking ends with
``</think>``. Their chat templates open it in the prompt, so the output starts inside it; a
``<think>`` the model writes first is dropped. Everything before ``</think>`` is reasoning,
everything after it content; an output that never closes it is all reasoning (a thought
that ran out of ``max_tokens``).

The split works on text, so a tag cut between two pieces of a stream is found all the
same: the end of a piece that could start a tag is held back until the next piece says.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")

THINK_START, THINK_END = "<think>", "</think>"


class ThinkSplitter:
    """One output's text, piece by piece, as (reasoning, content) pieces, as ``parser``
    reads it."""

    def __init__(self, parser: str = "deepseek_r1") -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        # deepseek_r1: the prompt opened the thought; qwen3: only a leading <think> does.
        self._opens_in_thought = parser == "deepseek_r1"
        self._held = ""  # text that may be the start of a tag
        self._started = False  # past a leading <think> (or sure there is none)
        self._thinking = True
        self.thought_tokens = 0
        """Tokens of the pieces whose text was all thought (the closing tag's included)."""

    @property
    def in_thought(self) -> bool:
        """Whether the output is still inside its thought (no ``</think>`` read yet)."""
        return self._thinking

    def push(self, text: str, final: bool = False, tokens: int = 0) -> tuple[str, str]:
        """The reasoning and content this piece (of ``tokens`` tokens) adds; ``final``: the
        output ends here, so nothing is held back."""
        thinking = self._thinking
        reasoning, content = self._split(text, final)
        if thinking and not content:
            self.thought_tokens += tokens
        return reasoning, content

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if not self._started:
            if not final and THINK_START.startswith(text) and len(text) < len(THINK_START):
                self._held = text
                return "", ""
            self._started = True
            self._thinking = self._opens_in_thought or text.startswith(THINK_START)
            text = text.removeprefix(THINK_START)
        if not self._thinking:
            return "", text
        end = text.find(THINK_END)
        if end >= 0:
            self._thinking = False
            return text[:end], text[end + len(THINK_END):]
        keep = 0 if final else _tag_prefix_at_end(text, THINK_END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""


def split_reasoning(text: str, parser: str = "deepseek_r1") -> tuple[str, str]:
    """A whole output as (reasoning, content)."""
    return ThinkSplitter(parser).push(text, final=True)


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` are the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
