"""Tiny Hugging Face checkpoints (random, seeded) shared by the model tests."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.model.arch import get_arch
from pdserve.model.loader import load_model
from pdserve.ops.reference import TorchAttentionBackend

transformers = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.08, bos_token_id=256, eos_token_id=257)


def _save(config, model_cls, folder, seed: int):
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    """GQA + Llama 3.1 rope scaling with a short original context, so scaling bites."""
    config = transformers.LlamaConfig(
        **_COMMON, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})
    folder = tmp_path_factory.mktemp("llama")
    return folder, _save(config, transformers.LlamaForCausalLM, folder, seed=0)


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory):
    """q/k/v biases and tied embeddings, like the small Qwen2.5 checkpoints."""
    config = transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True, rope_theta=1e6)
    folder = tmp_path_factory.mktemp("qwen2")
    hf = _save(config, transformers.Qwen2ForCausalLM, folder, seed=1)
    # HF inits biases to zero; random ones make the bias path count in the comparison.
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.uniform_(-0.2, 0.2)
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory):
    """Per-head query and key norms (random weights, so they count), an explicit head_dim
    other than hidden / heads, tied embeddings, like the small Qwen3 checkpoints."""
    config = transformers.Qwen3Config(**{**_COMMON, "head_dim": 24}, tie_word_embeddings=True,
                                      rope_theta=1e6)
    folder = tmp_path_factory.mktemp("qwen3")
    hf = _save(config, transformers.Qwen3ForCausalLM, folder, seed=2)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(folder)
    return folder, hf


def _load_pdserve(folder, **kwargs):
    model_config = ModelConfig(model=str(folder), dtype="float32", **kwargs)
    arch = get_arch(model_config)
    return load_model(model_config, arch, "cpu", "float32", TorchAttentionBackend())


@pytest.fixture(scope="session")
def load_pdserve():
    """``load_pdserve(folder, **model_config_fields)`` -> float32 model on the CPU."""
    return _load_pdserve
