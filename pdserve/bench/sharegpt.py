"""ShareGPT conversations as benchmark requests, the way ``vllm bench serve`` reads them.

The file is the public ShareGPT_V3 format: a JSON list of ``{"id": ..., "conversations":
[{"from": "human" | "gpt" | ..., "value": TEXT}, ...]}``. Each conversation gives its first
human turn followed by a gpt reply: the turn, tokenized by the served model's tokenizer, is
the prompt; the reply's token count is the output length. Conversations are shuffled with the
seed and taken in that order, skipping (as vLLM does) those with a prompt or reply under 4
tokens, a prompt over 1024 tokens, or prompt + reply over 2048 tokens (``max_context`` when
given).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.workloads import BenchError, BenchRequest

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
FORMAT = '[{"id": ..., "conversations": [{"from": "human", "value": ...}, ...]}, ...]'


class DatasetError(BenchError):
    """A dataset file that is missing or not in the expected format."""


@dataclass(frozen=True)
class TextTokenizer:
    """Text to token ids with (``special=True``) or without the model's added special tokens."""

    name: str
    encode: Callable[[str, bool], list[int]]


def hf_tokenizer(path: str) -> TextTokenizer:
    """A Hugging Face ``tokenizer.json`` (the file, or a folder holding it)."""
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise DatasetError(f"no tokenizer.json at {path}")
    tokenizer = Tokenizer.from_file(file)
    return TextTokenizer(file, lambda text, special: tokenizer.encode(
        text, add_special_tokens=special).ids)


def served_tokenizer(tokenizer: str | None, model: str | None,
                     owned_by: str | None) -> TextTokenizer | None:
    """The served model's tokenizer when it can be known here: ``--tokenizer``, else the
    model's own folder, else (pdserve serving a preset) the byte-level tokenizer pdserve
    gives presets. None when none of these applies."""
    if tokenizer:
        return hf_tokenizer(tokenizer)
    if model and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return hf_tokenizer(model)
    from pdserve.model.arch import PRESETS

    if owned_by == "pdserve" and model in PRESETS:
        from pdserve.model.tokenizer import ByteTokenizer

        byte = ByteTokenizer()
        return TextTokenizer(f"pdserve byte-level ({model})",
                             lambda text, special: byte.encode(text, add_special_tokens=special))
    return None


def load_exchanges(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply that follows it) of every conversation that has one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DatasetError(f"ShareGPT file not found: {path}") from None
    except (ValueError, OSError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise DatasetError(f"ShareGPT file {path} is not readable JSON: {exc}") from None
    if not isinstance(data, list):
        raise DatasetError(f"ShareGPT file {path}: expected a list of conversations {FORMAT}, "
                           f"got a JSON {type(data).__name__}")
    exchanges = []
    for index, entry in enumerate(data):
        exchange = _first_exchange(_turns(entry, index, path))
        if exchange is not None:
            exchanges.append(exchange)
    return exchanges


def _turns(entry, index: int, path: str | Path) -> list[dict]:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    valid = isinstance(turns, list) and all(
        isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
        for t in turns)
    if not valid:
        raise DatasetError(f"ShareGPT file {path}: entry {index} is not a conversation "
                           f"(expected {FORMAT})")
    return turns


def _first_exchange(turns: list[dict]) -> tuple[str, str] | None:
    for turn, reply in zip(turns, turns[1:], strict=False):
        if turn["from"] == "human" and reply["from"] == "gpt":
            return turn["value"], reply["value"]
    return None


def sharegpt_workload(path: str | Path, num: int, tokenizer: TextTokenizer | None,
                      seed: int = 0, max_context: int | None = None) -> list[BenchRequest]:
    """``num`` requests from the file's conversations (see the module doc)."""
    if tokenizer is None:
        raise DatasetError("a ShareGPT file needs the served model's tokenizer to count "
                           "tokens: pass --tokenizer (a tokenizer.json or its folder)")
    exchanges = load_exchanges(path)
    order = np.random.default_rng([seed, 4]).permutation(len(exchanges))
    requests = []
    for index in order:
        request = _request(*exchanges[index], tokenizer, max_context or MAX_TOTAL_LEN)
        if request is not None:
            requests.append(request)
            if len(requests) == num:
                return requests
    raise DatasetError(f"ShareGPT file {path}: only {len(requests)} of {len(exchanges)} "
                       f"conversations fit the length filters, {num} requests asked for")


def _request(prompt: str, reply: str, tokenizer: TextTokenizer,
             max_total: int) -> BenchRequest | None:
    prompt_ids = tokenizer.encode(prompt, True)
    output_len = len(tokenizer.encode(reply, False))
    if len(prompt_ids) < MIN_LEN or output_len < MIN_LEN:
        return None
    if len(prompt_ids) > MAX_PROMPT_LEN or len(prompt_ids) + output_len > max_total:
        return None
    return BenchRequest(prompt_ids, output_len)
