from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.config import ModelConfig
from pdserve.model.arch import PRESETS, get_arch
from pdserve.model.loader import load_model, resolve_dtype
from pdserve.model.testing import build_metadata, make_kv_caches
from pdserve.ops.reference import TorchAttentionBackend


def _copy_ckpt(src, dst, edit=None, shards: int = 1):
    """Copies a checkpoint, optionally editing its tensors and splitting it into shards."""
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    if edit:
        edit(tensors)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else \
            "model.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _same_weights(a, b):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_sharded_checkpoint_equals_single_file(llama_ckpt, load_pdserve, tmp_path):
    folder, _ = llama_ckpt
    sharded = _copy_ckpt(folder, tmp_path, shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    _same_weights(load_pdserve(folder), load_pdserve(sharded))


def test_tied_checkpoint_shares_embedding(qwen2_ckpt, load_pdserve):
    model = load_pdserve(qwen2_ckpt[0])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.model.embed_tokens.weight,
                               qwen2_ckpt[1].model.embed_tokens.weight)


def test_missing_weight_is_named(llama_ckpt, load_pdserve, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.self_attn.k_proj.weight"]

    broken = _copy_ckpt(llama_ckpt[0], tmp_path, edit=drop)
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.1\.self_attn\.k_proj"):
        load_pdserve(broken)


def test_wrong_shape_is_named(llama_ckpt, load_pdserve, tmp_path):
    def shrink(tensors):
        name = "model.layers.0.mlp.up_proj.weight"
        tensors[name] = tensors[name][:-1]

    broken = _copy_ckpt(llama_ckpt[0], tmp_path, edit=shrink)
    with pytest.raises(ValueError, match=r"up_proj\.weight.*shape \(127, 64\).*\(128, 64\)"):
        load_pdserve(broken)


def test_unexpected_weight_rejected_but_inv_freq_ignored(llama_ckpt, load_pdserve, tmp_path):
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["model.layers.0.self_attn.extra.weight"] = torch.ones(2)

    broken = _copy_ckpt(llama_ckpt[0], tmp_path, edit=add)
    with pytest.raises(ValueError, match=r"extra\.weight"):
        load_pdserve(broken)


def _dummy(name: str = "tiny", seed: int = 0, **arch_changes):
    model_config = ModelConfig(model=name, seed=seed)
    arch = dataclasses.replace(get_arch(model_config), **arch_changes)
    return load_model(model_config, arch, "cpu", "auto", TorchAttentionBackend())


def test_dummy_weights_are_seeded():
    a, b, c = _dummy(seed=3), _dummy(seed=3), _dummy(seed=4)
    _same_weights(a, b)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert torch.all(a.model.norm.weight == 1.0)
    assert a.model.embed_tokens.weight.abs().max() <= 0.02


def test_dummy_weights_stay_finite_through_80_layers_in_bf16():
    """Llama-3.1-70B's depth and head ratios at a width the CPU can afford."""
    arch = dataclasses.replace(PRESETS["llama3.1-70b"], vocab_size=512, hidden_size=128,
                               intermediate_size=448, num_heads=2, num_kv_heads=1, head_dim=64,
                               max_position_embeddings=128)
    model_config = ModelConfig(model="llama3.1-70b")
    model = load_model(model_config, arch, "cpu", "bfloat16", TorchAttentionBackend())
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.rotary.cos_sin_cache.dtype == torch.float32
    residual, logits = _run_layers(model, [1, 2, 3, 4, 5, 6, 7, 8])
    assert torch.isfinite(residual).all() and residual.abs().max() < 1e3
    assert torch.isfinite(logits).all()


def _run_layers(model, prompt):
    """(residual stream after the last layer, logits) for one prompt."""
    caches = make_kv_caches(model.arch, 2, 16, torch.bfloat16)
    meta = build_metadata([0], [len(prompt)], [[1]], 16)
    positions = torch.arange(len(prompt))
    with torch.no_grad():
        hidden = model.embed(torch.tensor(prompt))
        hidden, residual = model.forward_layers(hidden, None, positions, meta, caches, 0,
                                                model.num_layers)
        logits = model.compute_logits(model.final_norm(hidden, residual))
    return hidden.float() + residual.float(), logits


def test_load_format_checks(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        load_model(ModelConfig(model="tiny", load_format="safetensors"), PRESETS["tiny"], "cpu",
                   "auto", TorchAttentionBackend())


def test_dtype_resolution():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError):
        resolve_dtype("int4", "cpu")


def test_max_model_len_extends_rope_table():
    model_config = ModelConfig(model="tiny", max_model_len=8192)
    model = load_model(model_config, PRESETS["tiny"], "cpu", "auto", TorchAttentionBackend())
    assert model.rotary.cos_sin_cache.shape == (8192, PRESETS["tiny"].head_dim)


def test_a_cpu_engine_imports_neither_dynamo_nor_triton():
    """The loader builds on the meta device, where nn.Embedding's random init would import
    torch._dynamo (model load 1.2-1.5 s instead of 0.4-0.5 s on CPU) for values the weights
    replace; and a CPU engine never imports Triton (importing it outside the interpreter
    tests' set-up leaves them no active driver)."""
    code = ("import sys; from pdserve.engine.llm import LLM; LLM('tiny', device='cpu'); "
            "print('torch._dynamo' in sys.modules, 'triton' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "False False"
