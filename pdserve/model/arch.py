"""Shapes of a Llama-family model: parsed from a checkpoint's config.json or a named preset.

Presets carry the real published shapes, so dummy-weight runs of the big ones exercise the
same GEMMs, KV sizes and memory footprint as the real checkpoints.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArch:
    """Everything the model code needs to know about a Llama-family checkpoint."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", "factor": ..., ...}.
    # Excluded from the hash: a dict is unhashable and the other fields identify the model.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False  # Llama's attention_bias=True puts a bias on o_proj too; Qwen2 does not
    qk_norm: bool = False
    """Qwen3: each head's query and key RMS-normalised (weights of ``head_dim``) before RoPE."""
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    model_type: str = "llama"
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope scaling {rope_type!r} is not supported "
                                      f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token across all layers: what one token of context costs the pool."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding once."""
        qkv = self.hidden_size * (self.q_size + 2 * self.kv_size)
        qkv += (self.q_size + 2 * self.kv_size) if self.qkv_bias else 0
        attn = qkv + self.q_size * self.hidden_size + (self.hidden_size if self.o_bias else 0)
        mlp = 3 * self.hidden_size * self.intermediate_size
        layer = attn + mlp + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * layer + embed + head + self.hidden_size

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Reads a Hugging Face config.json (old ``rope_scaling`` or new ``rope_parameters``)."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if cfg.get("mlp_bias"):
            raise NotImplementedError("mlp_bias=True is not supported")
        num_heads = cfg["num_attention_heads"]
        theta, scaling = _parse_rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; its config says nothing of it.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            model_type=model_type,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list | tuple) else (int(value),)


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None); scaling always carries ``rope_type``, never the old ``type``."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 8192))
    return theta, {"rope_type": rope_type, **params}


_LLAMA3_EOS = (128001, 128008, 128009)

PRESETS: dict[str, ModelArch] = {
    # CPU demo and tests: vocab 320 holds the byte tokenizer's 256 bytes + BOS/EOS;
    # head_dim 64 keeps the GPU kernels on their ordinary tile sizes.
    "tiny": ModelArch(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=256,
        eos_token_ids=(257,), model_type="llama",
    ),
    "tiny-qwen2": ModelArch(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=4096, tie_word_embeddings=True, qkv_bias=True,
        bos_token_id=256, eos_token_ids=(257,), model_type="qwen2",
    ),
    "tiny-qwen3": ModelArch(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=256, eos_token_ids=(257,), model_type="qwen3",
    ),
    "llama3-8b": ModelArch(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009),
    ),
    "codellama-34b": ModelArch(
        vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_layers=48,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=1e6,
        max_position_embeddings=16384, bos_token_id=1, eos_token_ids=(2,),
    ),
    "llama3.1-70b": ModelArch(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=_LLAMA3_EOS,
    ),
}


def is_checkpoint_dir(model: str) -> bool:
    return os.path.isfile(os.path.join(model, "config.json"))


def load_hf_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def get_arch(model_config: ModelConfig) -> ModelArch:
    """The preset named by ``model_config.model``, or the shapes of a checkpoint folder."""
    name = model_config.model
    if is_checkpoint_dir(name):
        return ModelArch.from_hf_config(load_hf_config(name))
    if name in PRESETS:
        return PRESETS[name]
    raise ValueError(f"unknown model {name!r}: not a folder with config.json and not a preset "
                     f"({', '.join(PRESETS)})")
