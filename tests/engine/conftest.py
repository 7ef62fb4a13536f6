from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


def save_random_llama(folder, std: float, **config_overrides):
    """A random Llama checkpoint (safetensors) in ``folder``; returns the transformers model.

    Weights wider than the default init give distinct logits, so greedy decoding never
    hinges on a near-tie that float rounding could flip.
    """
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, **config_overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, std)
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    """A tiny random Llama checkpoint and its transformers model as the oracle."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = save_random_llama(
        folder, 0.2, vocab_size=300, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return str(folder), model


@pytest.fixture(scope="session")
def hf_llama_gpu(tmp_path_factory):
    """A larger random Llama on the GPU (head_dim 64, GQA 4:1) for the Triton path."""
    folder = tmp_path_factory.mktemp("gpu-llama")
    model = save_random_llama(
        folder, 0.1, vocab_size=1000, hidden_size=512, intermediate_size=1024,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=2048)
    return str(folder), model.cuda()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()
