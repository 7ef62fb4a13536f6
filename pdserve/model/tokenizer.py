"""Tokenizers (Hugging Face ``tokenizer.json`` or a byte-level fallback) and streaming decode.

The byte-level fallback lets presets and checkpoints without a tokenizer run end to end:
ids 0-255 are raw UTF-8 bytes, then BOS and EOS.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.model.arch import ModelArch

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    """Common surface of every tokenizer; subclasses implement encode/decode."""

    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int]
    vocab_size: int
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            **template_kwargs: Any) -> str:
        """The checkpoint's Jinja chat template (or a plain default; ``chat_template``
        overrides both) rendered to a prompt; ``template_kwargs`` are extra variables.

        The result may already start with the BOS text; encode it with
        ``add_special_tokens=False`` in that case to avoid a second BOS.
        """
        template = _compile_template(chat_template or self.chat_template
                                     or DEFAULT_CHAT_TEMPLATE)
        return template.render(**template_kwargs, messages=messages,
                               add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def starts_with_bos(self, text: str) -> bool:
        return bool(self.bos_token) and text.startswith(self.bos_token)

    @functools.cached_property
    def piece_table(self) -> dict[int, str]:
        """Token id -> its text inside any output, for the tokens whose text never depends on
        their neighbours: appended after such a token, a table token adds exactly this text
        to the decode. Streaming then looks a token up instead of decoding a window. Built
        on first use; empty when this tokenizer cannot promise it (every token decodes)."""
        return self._build_piece_table()

    def _build_piece_table(self) -> dict[int, str]:
        return {}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=16)  # a compile costs milliseconds; requests reuse a few templates
def _compile_template(source: str) -> jinja2.Template:
    # Same environment settings as Hugging Face, so checkpoint templates render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent,
                                                                  ensure_ascii=False)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def load_chat_template(value: str) -> str:
    """``--chat-template``: a template file's text, or the value itself when it is a template.

    Compiled here, so a syntax error stops start-up instead of failing every chat request.
    """
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            source = f.read()
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"chat template file {value!r} does not exist (an inline template "
                         "must contain {{ or {%)")
    try:
        _compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template {value!r} line {exc.lineno}: {exc.message}") from None
    return source


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0-255, BOS = 256, EOS = 257; special texts in input are parsed."""

    BOS, EOS = 256, 257

    def __init__(self, chat_template: str | None = None) -> None:
        self.bos_token, self.eos_token = "<s>", "</s>"
        self.bos_token_id = self.BOS
        self.eos_token_ids = [self.EOS]
        self.vocab_size = 258
        self.chat_template = chat_template
        self._specials = {self.bos_token: self.BOS, self.eos_token: self.EOS}
        self._special_re = re.compile("(" + "|".join(map(re.escape, self._specials)) + ")")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.BOS] if add_special_tokens else []
        for piece in self._special_re.split(text):
            if piece in self._specials:
                ids.append(self._specials[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        try:  # all plain bytes, the common case: the server decodes twice per streamed chunk
            return bytes(ids).decode("utf-8", errors="replace")
        except ValueError:
            pass
        # Ids past the byte range (a dummy model's vocab is larger) decode to nothing.
        if skip_special_tokens:
            return bytes([i for i in ids if 0 <= i < 256]).decode("utf-8", errors="replace")
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            if not skip_special_tokens and i in (self.BOS, self.EOS):
                out.append(run.decode("utf-8", errors="replace"))
                out.append(self.bos_token if i == self.BOS else self.eos_token)
                run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def _build_piece_table(self) -> dict[int, str]:
        # An ASCII byte is a whole character; every other byte may be part of one.
        return {i: chr(i) for i in range(128)}


class HFTokenizer(Tokenizer):
    """A ``tokenizers`` tokenizer.json with the special tokens of tokenizer_config.json."""

    def __init__(self, folder: str, arch: ModelArch | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self._tok = _RustTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        if self.bos_token_id is None and arch is not None:
            self.bos_token_id = arch.bos_token_id
        self.eos_token_ids = _eos_ids(self._id_of(self.eos_token), folder, arch)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = _pick_template(config.get("chat_template"), folder)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _build_piece_table(self) -> dict[int, str]:
        decoder = json.loads(self._tok.to_str()).get("decoder")
        if not _decoder_appends_pieces(decoder):
            return {}
        anchor = self.encode("a", add_special_tokens=False)[-1:]
        anchor_text = self.decode(anchor)
        if not anchor_text:
            return {}
        added = set(self._tok.get_added_tokens_decoder())
        ids = [i for i in range(self._tok.get_vocab_size(with_added_tokens=False))
               if i not in added and not _BYTE_FALLBACK.match(self._tok.id_to_token(i) or "")]
        texts = self._tok.decode_batch([anchor + [i] for i in ids], skip_special_tokens=False)
        return {i: text[len(anchor_text):] for i, text in zip(ids, texts, strict=True)
                if _is_whole_piece(text, anchor_text)}


# Decoders that map each token to text on its own, so a token's text after another token does
# not depend on what came before. Three exceptions, each handled by the table's users or
# builder: a Strip that follows Fuse and Metaspace act on the output's first token only (the
# table is only used after a token with text); ByteFallback joins runs of <0xNN> tokens into
# one character (those tokens stay out of the table); ByteLevel joins bytes of neighbouring
# tokens (only tokens that are whole UTF-8 text are in the table).
_PIECEWISE_DECODERS = {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")


def _decoder_appends_pieces(decoder: dict[str, Any] | None) -> bool:
    if decoder is None:
        return False
    if decoder.get("type") != "Sequence":
        return _piecewise(decoder)
    steps = decoder.get("decoders", [])
    fused = next((i for i, d in enumerate(steps) if d.get("type") == "Fuse"), len(steps))
    # After Fuse a step sees the whole text at once (a Replace could match across two
    # tokens): only the leading Strip may follow it.
    return (all(_piecewise(d) for d in steps[:fused])
            and all(d.get("type") == "Strip" and _piecewise(d) for d in steps[fused + 1:]))


def _piecewise(decoder: dict[str, Any]) -> bool:
    if decoder.get("type") == "Strip":  # a stop strip would cut the newest token's end
        return decoder.get("stop", 0) == 0 and decoder.get("start", 0) <= 1
    return decoder.get("type") in _PIECEWISE_DECODERS


def _is_whole_piece(text: str, anchor_text: str) -> bool:
    return len(text) > len(anchor_text) and text.startswith(anchor_text) and "\ufffd" not in text


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _eos_ids(tokenizer_eos: int | None, folder: str, arch: ModelArch | None) -> list[int]:
    """Union of every EOS the checkpoint declares (Llama 3.1 instruct has three)."""
    ids: list[int] = [] if tokenizer_eos is None else [tokenizer_eos]
    gen = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
    extra = list(arch.eos_token_ids) if arch is not None else []
    extra += gen if isinstance(gen, list) else ([gen] if gen is not None else [])
    for i in extra:
        if i not in ids:
            ids.append(i)
    return ids


def _pick_template(template: str | list | None, folder: str) -> str | None:
    # Newer checkpoints keep the template in its own file; some list several by name.
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
        with open(jinja_path) as f:
            template = f.read()
    return template


def load_tokenizer(path: str | None, arch: ModelArch | None = None) -> Tokenizer:
    """tokenizer.json from ``path`` when there is one, else the byte-level fallback."""
    if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path, arch)
    template = None
    if path and os.path.isdir(path):
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = _pick_template(config.get("chat_template"), path)
    return ByteTokenizer(template)


class IncrementalDetokenizer:
    """Streams the text of generated tokens: each ``push`` returns only text that is final.

    Text is decoded over a short window of tokens (vLLM's prefix/read offsets) so that a
    push costs O(new tokens), and a token that merges with its neighbours (SentencePiece
    spaces, a UTF-8 character split over byte tokens) is emitted only once complete. A tail
    that could still grow into a stop string is held back until it cannot.

    The common token needs no decode at all: when the window's text is complete and every new
    token is in the tokenizer's ``piece_table``, the new text is the tokens' table texts, and
    the window moves exactly as the decode would have moved it (``_push_pieces``).
    """

    # Decode this many prompt tokens as left context so the first output token is spaced
    # as it would be inside the full text.
    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: list[str] | str | None = None, skip_special_tokens: bool = True,
                 use_piece_table: bool = True) -> None:
        self.tokenizer = tokenizer
        self._pieces = tokenizer.piece_table if use_piece_table else {}
        self.skip_special_tokens = skip_special_tokens
        stop = [stop] if isinstance(stop, str) else (stop or [])
        self.stop = [s for s in stop if s]
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._ids = list(prompt_token_ids[-self.PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""  # final text not yet returned: it might begin a stop string
        self.stopped = False
        self.stop_reason: str | None = None

    def push(self, new_token_ids: list[int]) -> str:
        """Newly final text for ``new_token_ids``; "" once a stop string was hit."""
        if self.stopped:
            return ""
        text = self._push_pieces(new_token_ids)
        if text is None:
            self._ids.extend(new_token_ids)
            text = self._decode_tail(final=False)
        if not self.stop:
            return text  # nothing is ever held back
        self._held += text
        return self._release()

    def _push_pieces(self, new_token_ids: list[int]) -> str | None:
        """The new text by table look-up, or None when only a decode can tell. Safe when the
        last token decoded had text of its own (in the table) and left nothing pending: then
        the decode of the window plus table tokens is the window's text plus theirs."""
        ids, pieces = self._ids, self._pieces
        if not (new_token_ids and ids and self._read_offset == len(ids) and ids[-1] in pieces):
            return None
        try:
            text = "".join([pieces[i] for i in new_token_ids])
        except KeyError:
            return None
        # Where _decode_tail would leave the window: the new tokens, all read.
        self._ids = list(new_token_ids)
        self._prefix_offset, self._read_offset = 0, len(new_token_ids)
        return text

    def flush(self) -> str:
        """At the end of generation: the held-back tail (and any never-completed character)."""
        if self.stopped:
            return ""
        text = self._held + self._decode_tail(final=True)
        self._held = ""
        return text

    def _decode_tail(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""  # no token since the last text
        decode = self.tokenizer.decode
        window = self._ids[self._prefix_offset:]
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset],
                             self.skip_special_tokens)
        full_text = decode(window, self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or a multi-byte character is still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim()
        return full_text[len(prefix_text):]

    def _trim(self) -> None:
        # Ids before the prefix window are never decoded again; dropping them keeps every
        # push independent of how long the output already is.
        if self._prefix_offset > 0:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _release(self) -> str:
        hit = self._find_stop()
        if hit is not None:
            index, stop = hit
            self.stopped, self.stop_reason = True, stop
            text, self._held = self._held[:index], ""
            return text
        keep = self._hold_length()
        text = self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]
        return text

    def _find_stop(self) -> tuple[int, str] | None:
        # ``_held`` never holds more than the longest stop minus one char of old text, so
        # any stop string that ends in the new text starts inside ``_held``.
        hits = [(self._held.find(s), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits) if hits else None

    def _hold_length(self) -> int:
        """Length of the longest tail of ``_held`` that is a proper prefix of a stop string."""
        for k in range(min(self._max_hold, len(self._held)), 0, -1):
            tail = self._held[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
