"""Grammars for constrained sampling, on llguidance.

The engine holds one ``GrammarCompiler`` (its tokenizer's token table is built once, on the
first grammar); each request with a grammar gets a ``Matcher``, a copy of the compiled
grammar's fresh matcher. Before a step samples, the host writes each grammar row's allowed
tokens into a bitmask (32 tokens per int32 word) and the sampler applies it on the device;
the matcher is advanced when the engine appends the sampled token.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from typing import Any

import torch

from pdserve.sampling_params import GrammarSpec, InvalidRequestError

log = logging.getLogger(__name__)
INSTALL_HINT = "pip install 'pdserve[structured]'"
COMPILED_CACHE_SIZE = 128
"""Compiled grammars kept (LRU by kind and text): requests tend to reuse a few schemas."""
JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON: a model cannot spend its token budget on free whitespace (a schema may
turn it back on with ``"x-guidance": {"whitespace_flexible": true}``)."""


def import_llguidance(field: str):
    """The llguidance module; a request that needs it without it installed is refused."""
    try:
        import llguidance
    except ImportError:
        raise InvalidRequestError(f"{field}: structured output needs llguidance, which is not "
                                  f"installed on this server ({INSTALL_HINT})") from None
    return llguidance


def check_grammar(spec: GrammarSpec) -> None:
    """Raises ``InvalidRequestError`` naming ``spec.field`` if the grammar is not valid."""
    _checked(spec)


@functools.lru_cache(maxsize=COMPILED_CACHE_SIZE)
def _checked(spec: GrammarSpec) -> str:
    llg = import_llguidance(spec.field)
    grammar = _to_llguidance(llg, spec)
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{spec.field} is not a valid {_KIND_NAMES[spec.kind]}: "
                                  f"{error.strip()}")
    return grammar


_KIND_NAMES = {"json": "JSON schema", "regex": "regular expression",
               "choice": "list of choices", "grammar": "grammar (Lark or GBNF)"}


def _to_llguidance(llg, spec: GrammarSpec) -> str:
    try:
        if spec.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "choice":
            return llg.grammar_from("choice", spec.source)
        return llg.grammar_from("grammar", spec.source)
    except ValueError as exc:
        raise InvalidRequestError(f"{spec.field} is not a valid {_KIND_NAMES[spec.kind]}: "
                                  f"{exc}") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer; ``matcher`` gives each request its own."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer = None  # built on the first grammar (about a second for 128k)
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for ``spec``; raises ``InvalidRequestError`` naming its field."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compile(spec)
        self._compiled.move_to_end(spec)
        while len(self._compiled) > COMPILED_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return Matcher(compiled.deep_copy())

    def token_table(self, llg):
        """The ``llguidance.LLTokenizer`` of this compiler's tokenizer."""
        from pdserve.structured.tokens import ll_tokenizer

        return ll_tokenizer(llg, self.tokenizer, self.vocab_size)

    def _compile(self, spec: GrammarSpec):
        llg = import_llguidance(spec.field)
        grammar = _checked(spec)
        if self._ll_tokenizer is None:
            self._ll_tokenizer = self.token_table(llg)
        compiled = llg.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise InvalidRequestError(f"{spec.field}: {compiled.get_error()}")
        self._compiled[spec] = compiled
        return compiled


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.consumed_eos = False

    def accept(self, token_id: int, is_eos: bool) -> None:
        """Advances past a sampled token (an EOS the grammar allowed ends it)."""
        if self._matcher.is_stopped():
            self.consumed_eos = is_eos
            return
        if not self._matcher.consume_token(token_id):
            # Only a token the mask refused can get here (a bug, or a first token sampled
            # elsewhere without the grammar): the request ends as failed, never silently.
            log.error("a token left the grammar: %s", self._matcher.get_error())
        self.consumed_eos = is_eos and self._matcher.is_stopped()

    @property
    def raw(self) -> Any:
        return self._matcher

    @property
    def failed(self) -> str | None:
        """Why the matcher stopped working (it then allows only EOS), or None."""
        return self._matcher.get_error() if self._matcher.is_error() else None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def fill_bitmask(matchers: list[Matcher], vocab_size: int, pin: bool) -> torch.Tensor:
    """The allowed tokens of each matcher's next step, one int32 row per matcher (bit ``t %
    32`` of word ``t // 32``), computed in parallel on llguidance's threads."""
    from llguidance.torch import fill_next_token_bitmask_par

    bitmask = torch.empty((len(matchers), bitmask_words(vocab_size)), dtype=torch.int32,
                          pin_memory=pin)
    fill_next_token_bitmask_par(_executor(), [(m.raw, i) for i, m in enumerate(matchers)],
                                bitmask)
    return bitmask


def choices_source(choices: list[str]) -> str:
    return json.dumps(choices)
