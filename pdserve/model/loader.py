"""Builds a model on its device: from Hugging Face safetensors, or with dummy weights.

The module is first built on the meta device (no memory, no init kernels), then given
uninitialised storage on the target device, then filled. Checkpoint tensors are streamed one
at a time from memory-mapped files straight into their (fused) parameter, so a 70B
checkpoint is never held on the host in full, let alone twice. Under tensor parallelism each
rank reads only its slice of each tensor (``safe_open(...).get_slice``: the rows or columns
it holds, never the whole tensor).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from pdserve.config import ModelConfig
from pdserve.dist.comm import SINGLE, TPComm
from pdserve.dist.shard import TPShard
from pdserve.model.arch import PRESETS, ModelArch, is_checkpoint_dir
from pdserve.model.llama import AttentionBackend, LlamaForCausalLM
from pdserve.progress import progress

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "half": torch.float16, "float": torch.float32}

# Dummy weights: uniform(-a, a) keeps activations O(1) after every norm, so 80 layers stay
# finite in bf16; norms start at 1.0 as in a real checkpoint.
DUMMY_WEIGHT_RANGE = 0.02

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# HF name -> (our fused parameter, shard index); shards are laid out in this order.
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_FUSED_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """"auto" is bfloat16 on CUDA (tensor cores, half the bytes) and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (auto, {', '.join(_DTYPES)})")
    return _DTYPES[dtype]


def load_model(model_config: ModelConfig, arch: ModelArch, device: torch.device | str,
               dtype: str | torch.dtype, attn_backend: AttentionBackend,
               shard: TPShard | None = None, comm: TPComm = SINGLE) -> LlamaForCausalLM:
    """The model on ``device`` in eval mode, weights from the checkpoint or random (seeded).
    With a ``shard``: only that tensor-parallel rank's part (dummy weights are then seeded
    per rank, so they differ from one group size to another)."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    shard = shard or TPShard(arch)
    model = _build_empty(model_config, arch, device, dtype, attn_backend, shard, comm)
    if _use_dummy(model_config):
        init_dummy_weights(model, model_config.seed + shard.rank)
    else:
        load_safetensors(model, model_config.model)
    return model.eval().requires_grad_(False)


def _use_dummy(model_config: ModelConfig) -> bool:
    fmt = model_config.load_format
    if fmt == "dummy":
        return True
    if fmt not in ("auto", "safetensors"):
        raise ValueError(f"unknown load_format {fmt!r} (auto, safetensors, dummy)")
    if is_checkpoint_dir(model_config.model):
        return False
    if fmt == "safetensors" or model_config.model not in PRESETS:
        raise ValueError(f"{model_config.model!r} is not a checkpoint folder with config.json")
    return True


def _build_empty(model_config: ModelConfig, arch: ModelArch, device: torch.device,
                 dtype: torch.dtype, attn_backend: AttentionBackend, shard: TPShard,
                 comm: TPComm) -> LlamaForCausalLM:
    max_positions = max(model_config.max_model_len or 0, arch.max_position_embeddings)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, attn_backend, max_positions, shard, comm)
    model.to(dtype)  # on meta: free; the rope table is rebuilt in float32 below
    model.to_empty(device=device)
    model.tie_weights()  # storage was swapped per module, so re-share embedding and head
    model.rotary.reset_cache(device)
    return model


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights generated on the model's device (seconds even for 70B on GPU)."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)


def checkpoint_files(folder: str) -> list[str]:
    """Safetensors files of a checkpoint: the index's shards, or every *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return [os.path.join(folder, n) for n in names]


def iter_checkpoint(folder: str) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs: ``handle[...]`` reads only the part indexed, one tensor in
    host memory at a time (files are memory-mapped)."""
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def read_part(handle: Any, shard: TPShard, hf_name: str) -> torch.Tensor:
    """The rows or columns of a checkpoint tensor that ``shard`` holds (all of it on one
    rank); ValueError when the tensor's full extent is not the model's."""
    part = shard.slice_of(hf_name)
    if part is None:
        return handle[:]
    dim, start, stop, full = part
    shape = handle.get_shape()
    if len(shape) <= dim or shape[dim] != full:
        raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(shape)}, the model "
                         f"expects {full} along dimension {dim}")
    return handle[start:stop] if dim == 0 else handle[:, start:stop]


def count_tensors(folder: str) -> int:
    """Tensors in the checkpoint (reads only the files' headers)."""
    total = 0
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


def map_hf_name(hf_name: str) -> tuple[str, int | None]:
    """HF tensor name -> (our parameter name, shard index inside a fused parameter or None)."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
    return hf_name, None


@torch.no_grad()
def load_safetensors(model: LlamaForCausalLM, folder: str) -> None:
    """Copies every checkpoint tensor into its parameter; errors name the offending tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[str, int | None]] = set()
    tensors = progress(iter_checkpoint(folder), total=count_tensors(folder),
                       desc="loading weights", unit="tensor")
    for hf_name, handle in tensors:
        if _IGNORED.search(hf_name) or _is_tied_head(model, hf_name):
            continue
        name, shard = map_hf_name(hf_name)
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model "
                             f"(looked for parameter {name!r})")
        tensor = read_part(handle, model.shard, hf_name)
        target = _vocab_rows(model, name, _shard_view(model.arch, params[name], name, shard))
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(target.shape)}")
        target.copy_(tensor)
        loaded.add((name, shard))
    _check_complete(model, params, loaded)


def _is_tied_head(model: LlamaForCausalLM, hf_name: str) -> bool:
    # Some tied checkpoints still store a copy of the head; the embedding is the truth.
    return model.arch.tie_word_embeddings and hf_name == "lm_head.weight"


def _vocab_rows(model: LlamaForCausalLM, name: str, param: torch.Tensor) -> torch.Tensor:
    """Embedding and head rows that hold real tokens; padding rows stay zero."""
    if model.comm.size == 1 or name not in ("model.embed_tokens.weight", "lm_head.weight"):
        return param
    param[model.shard.vocab_rows:].zero_()
    return param[:model.shard.vocab_rows]


def _shard_view(arch: ModelArch, param: torch.Tensor, name: str,
                shard: int | None) -> torch.Tensor:
    if shard is None:
        return param
    if ".qkv_proj." in name:
        sizes = [arch.q_size, arch.kv_size, arch.kv_size]
    else:
        sizes = [arch.intermediate_size] * 2
    return param.split(sizes, dim=0)[shard]


def _expected(params: dict[str, torch.Tensor], model: LlamaForCausalLM,
              ) -> set[tuple[str, int | None]]:
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        if model.arch.tie_word_embeddings and name == "lm_head.weight":
            continue
        fused = next((f for f in _FUSED_SHARDS if f".{f}." in name), None)
        shards = range(_FUSED_SHARDS[fused]) if fused else [None]
        expected.update((name, s) for s in shards)
    return expected


def _check_complete(model: LlamaForCausalLM, params: dict[str, torch.Tensor],
                    loaded: set[tuple[str, int | None]]) -> None:
    missing = _expected(params, model) - loaded
    if not missing:
        return
    names = sorted(_hf_name(n, s) for n, s in missing)
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    raise ValueError(f"checkpoint is missing {len(names)} weight(s): {shown}")


def _hf_name(name: str, shard: int | None) -> str:
    if shard is None:
        return name
    for hf_part, (fused, index) in _FUSED.items():
        if index == shard and f".{fused}." in name:
            return name.replace(f".{fused}.", f".{hf_part}.")
    return name
