from __future__ import annotations

import json

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.model.arch import PRESETS, ModelArch, get_arch
from pdserve.model.llama import LlamaForCausalLM
from pdserve.ops.reference import TorchAttentionBackend

# Published parameter counts of the real checkpoints.
REAL_PARAMS = {"llama3-8b": 8_030_261_248, "codellama-34b": 33_743_970_304,
               "llama3.1-70b": 70_553_706_496}

LLAMA31_CONFIG = {  # the shape of Meta-Llama-3.1-8B-Instruct's config.json (older format)
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_llama31_config():
    arch = ModelArch.from_hf_config(LLAMA31_CONFIG)
    assert arch.eos_token_ids == (128001, 128008, 128009)
    assert arch.rope_scaling["rope_type"] == "llama3" and arch.rope_theta == 500000.0
    assert arch.head_dim == 128 and arch.num_kv_heads == 8 and not arch.qkv_bias


def test_old_linear_scaling_and_mistral_and_qwen():
    codellama_like = {"model_type": "llama", "vocab_size": 32016, "hidden_size": 64,
                      "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "rope_scaling": {"type": "linear", "factor": 2.0},
                      "eos_token_id": 2}
    arch = ModelArch.from_hf_config(codellama_like)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.num_kv_heads == 4 and arch.eos_token_ids == (2,)
    mistral = {**codellama_like, "model_type": "mistral", "rope_scaling": None,
               "num_key_value_heads": 2, "rope_theta": 1e6}
    assert ModelArch.from_hf_config(mistral).rope_scaling is None
    qwen = {**mistral, "model_type": "qwen2", "tie_word_embeddings": True}
    arch = ModelArch.from_hf_config(qwen)
    assert arch.qkv_bias and not arch.o_bias and arch.tie_word_embeddings


def test_unsupported_configs_fail_loudly():
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match="model_type"):
        ModelArch.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(NotImplementedError, match="yarn"):
        ModelArch.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("name", sorted(REAL_PARAMS))
def test_big_presets_have_published_shapes(name):
    """Built on the meta device: real shapes checked without allocating a byte."""
    arch = PRESETS[name]
    assert arch.num_parameters() == REAL_PARAMS[name]
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, TorchAttentionBackend())
    assert sum(p.numel() for p in model.parameters()) == REAL_PARAMS[name]


def test_codellama_preset():
    arch = PRESETS["codellama-34b"]
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (48, 8192,
                                                                                       64, 8)
    assert (arch.intermediate_size, arch.vocab_size, arch.rope_theta,
            arch.max_position_embeddings) == (22016, 32000, 1e6, 16384)


def test_tiny_presets_fit_byte_tokenizer():
    for name in ("tiny", "tiny-qwen2"):
        assert PRESETS[name].vocab_size >= 259
    assert PRESETS["tiny-qwen2"].qkv_bias and PRESETS["tiny-qwen2"].tie_word_embeddings


def test_get_arch(tmp_path):
    assert get_arch(ModelConfig(model="tiny")) is PRESETS["tiny"]
    (tmp_path / "config.json").write_text(json.dumps(LLAMA31_CONFIG))
    assert get_arch(ModelConfig(model=str(tmp_path))).vocab_size == 128256
    with pytest.raises(ValueError, match="unknown model"):
        get_arch(ModelConfig(model="no-such-model"))


def test_arch_is_hashable():
    assert hash(PRESETS["llama3.1-70b"]) == hash(PRESETS["llama3.1-70b"])
