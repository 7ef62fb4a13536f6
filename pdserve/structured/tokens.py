"""The model's tokenizer as llguidance sees it: every token id's bytes, and the EOS ids."""

from __future__ import annotations

from typing import Any

from pdserve.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def ll_tokenizer(llg, tokenizer: Tokenizer, vocab_size: int):
    """An ``llguidance.LLTokenizer`` over ``vocab_size`` ids (the model's logits may be wider
    than the tokenizer's table: those ids are special, so never allowed in text)."""
    eos = list(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        # llguidance reads the Hugging Face tokenizer.json itself, added tokens included.
        return llg.LLTokenizer(tokenizer._tok.to_str(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTable(tokenizer, vocab_size)),
                               n_vocab=vocab_size, eos_token=eos)
    raise ValueError(f"no llguidance token table for {type(tokenizer).__name__}")


class _ByteTable:
    """What ``llguidance.TokenizerWrapper`` reads: ids 0-255 are bytes, the rest special."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        names = {tokenizer.BOS: tokenizer.bos_token, tokenizer.EOS: tokenizer.eos_token}
        self.tokens = [bytes([i]) for i in range(256)] + [
            names.get(i, f"<|unused_{i}|>").encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))
        self._tokenizer = tokenizer

    def __call__(self, text: Any) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(text, add_special_tokens=False)
