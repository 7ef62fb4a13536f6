"""Tiny Hugging Face checkpoints whose shapes stress the tensor-parallel split."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.arch import PRESETS

transformers = pytest.importorskip("transformers")

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2)


def _save(folder, std: float, **overrides):
    """A random Llama checkpoint in ``folder``; weights wider than the default init give
    distinct logits, so greedy picks never hinge on a near-tie that a different order of
    summation (per-rank partial sums) could flip."""
    config = transformers.LlamaConfig(**{**_COMMON, **overrides})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            (param.normal_(0, std) if param.dim() == 2 else param.uniform_(-0.2, 0.2))
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def gqa_ckpt(tmp_path_factory):
    """Grouped-query attention (4 query heads on 2 KV heads), a vocabulary of 301 (odd: the
    last rank's shard is padded) and biases on q/k/v/o (the o bias must be added once)."""
    folder = tmp_path_factory.mktemp("tp-gqa")
    model = _save(folder, 0.2, vocab_size=301, num_key_value_heads=2, attention_bias=True,
                  tie_word_embeddings=False)
    return str(folder), model


@pytest.fixture(scope="session")
def mqa_ckpt(tmp_path_factory):
    """One KV head for 4 query heads, fewer KV heads than ranks (replicated on both), odd
    vocabulary, and a head tied to the embedding (both split by vocabulary rows)."""
    folder = tmp_path_factory.mktemp("tp-mqa")
    model = _save(folder, 0.2, vocab_size=299, num_key_value_heads=1,
                  tie_word_embeddings=True)
    return str(folder), model


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The tiny preset's shapes as a checkpoint: dummy weights are seeded per rank, so only
    a checkpoint gives TP=1 and TP=2 the same model."""
    arch = PRESETS["tiny"]
    folder = tmp_path_factory.mktemp("tp-tiny")
    _save(folder, 0.1, vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
          intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_layers,
          num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads)
    return str(folder)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()
