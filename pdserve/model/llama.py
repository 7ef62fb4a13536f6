"""Llama-family decoder (Llama 2/3/3.1, CodeLlama, Mistral, Qwen2) over a paged KV cache.

The batch (``AttentionMetadata``) and the KV caches are arguments of every call: a decode
batch and a prefill piece may run through the same model at the same time. The forward has
no host syncs and no data-dependent Python branches, so a decode step can be captured as a
CUDA graph. Fused ops go through ``pdserve.ops.dispatch`` (Triton on CUDA, torch on CPU).

Under tensor parallelism (``TPShard``, ``TPComm``) each rank builds the layers of its shard:
its query and KV heads, its slice of the MLP and of the vocabulary. o_proj and down_proj sum
their partial products across ranks; the embedding sums the rows each rank owns; the LM head
gathers every rank's logits and cuts the vocabulary padding. With one rank there is no
collective and no extra op.

With ``decode_gemv`` set (one rank), steps of at most ``GEMV_MAX_ROWS`` tokens run each
layer's fused form, ``LlamaDecoderLayer.forward_gemv``: four GEMVs with the norms, SiLU and
residual adds inside them, over one residual stream instead of (hidden, residual).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.dist.comm import SINGLE, TPComm
from pdserve.dist.shard import TPShard
from pdserve.model.arch import ModelArch
from pdserve.ops import dispatch
from pdserve.ops.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(Protocol):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse frequencies exactly as Hugging Face computes them (float32, on the CPU)."""
    dim = arch.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (arch.rope_theta ** exponents)
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, the middle blended."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(arch: ModelArch, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(arch).to(device)
    positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch, self.max_positions = arch, max_positions
        device = torch.empty(0).device  # honours an enclosing ``with torch.device(...)``
        self.register_buffer("cos_sin_cache", self._build(device), persistent=False)

    def _build(self, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return torch.empty(self.max_positions, self.arch.head_dim, device=device)
        return rope_cos_sin_cache(self.arch, self.max_positions, device)

    def reset_cache(self, device: torch.device | str) -> None:
        """Recomputes the table (float32) after the module moved off the meta device."""
        self.cos_sin_cache = self._build(torch.device(device))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


def row_parallel(linear: nn.Linear, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """``linear`` over this rank's input columns, summed over ranks; the bias added once."""
    if comm.size == 1:
        return linear(x)
    out = comm.all_reduce(F.linear(x, linear.weight))
    return out if linear.bias is None else out + linear.bias


class LlamaAttention(nn.Module):
    """``arch`` is this rank's shapes: its own query and KV heads."""

    def __init__(self, arch: ModelArch, backend: AttentionBackend, comm: TPComm = SINGLE) -> None:
        super().__init__()
        self.backend, self.comm = backend, comm
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.scale = arch.head_dim ** -0.5
        # One GEMM for q, k and v: rows [q | k | v], filled from three HF tensors.
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        qkv = self.project_qkv(hidden, positions, meta.slot_mapping, kv_cache, cos_sin_cache)
        return self.project_out(self.attend(qkv, meta, kv_cache))

    def project_qkv(self, hidden: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_cache: KVCache,
                    cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """[T, q + 2 kv] with q and k rotated and k and v stored: everything before the
        attention itself, which depends on the batch's shape only through T."""
        return self.rotate_and_store(self.qkv_proj(hidden), positions, slot_mapping, kv_cache,
                                     cos_sin_cache)

    def rotate_and_store(self, qkv: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_cache: KVCache,
                         cos_sin_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(qkv)
        self.normalize_qk(q, k)
        # One launch rotates q and k in place and stores k and v; the backend only attends.
        dispatch.rope_store_kv(q, k, v, positions, cos_sin_cache, kv_cache[0], kv_cache[1],
                               slot_mapping)
        return qkv

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Qwen3's per-head RMSNorm of the queries and keys, in place (they are views into
        the projection, rows apart: normalised as one copy each, written back)."""
        if not self.qk_norm:
            return
        for heads, norm in ((q, self.q_norm), (k, self.k_norm)):
            rows = heads.reshape(-1, self.head_dim)
            heads.copy_(dispatch.rms_norm(rows, norm.weight, norm.eps).view_as(heads))

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim),
                k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def attend(self, qkv: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
               ) -> torch.Tensor:
        q, k, v = self.split_qkv(qkv)
        return self.backend.attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)

    def rope_store_attend(self, qkv: torch.Tensor, positions: torch.Tensor,
                          meta: AttentionMetadata, kv_cache: KVCache,
                          cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """Rotary, K/V store and attention of an unrotated projection in the backend's
        decode kernel (a batch the backend ``fuses_rope``)."""
        q, k, v = self.split_qkv(qkv)
        self.normalize_qk(q, k)
        return self.backend.rope_store_attend(q, k, v, positions, cos_sin_cache, kv_cache[0],
                                              kv_cache[1], meta, self.scale)

    def project_out(self, attn_out: torch.Tensor) -> torch.Tensor:
        return row_parallel(self.o_proj, attn_out.reshape(-1, self.q_size), self.comm)


# The MLP of a big step runs in slices of this many tokens: its [tokens, 2 x intermediate]
# activation is the largest tensor of a prefill step (0.7 GB at 8K tokens on a 34B model),
# and every byte of activation reserve is KV memory lost. Slices of 2,048 rows keep the
# GEMMs large (about 1.5 TFLOP each on a 34B model).
MLP_CHUNK_TOKENS = 2048


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, comm: TPComm = SINGLE) -> None:
        super().__init__()
        self.comm = comm
        # One GEMM for gate and up: rows [gate | up], as silu_and_mul expects.
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if num_tokens <= MLP_CHUNK_TOKENS:  # always true for decode steps and their graphs
            return self._mlp(hidden)
        out = torch.empty_like(hidden)
        for start in range(0, num_tokens, MLP_CHUNK_TOKENS):
            rows = slice(start, start + MLP_CHUNK_TOKENS)
            out[rows] = self._mlp(hidden[rows])
        return out

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        return row_parallel(self.down_proj, dispatch.silu_and_mul(self.gate_up_proj(hidden)),
                            self.comm)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, comm: TPComm = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, backend, comm)
        self.mlp = LlamaMLP(arch, comm)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        if attn.backend.fuses_rope(meta):  # decided by the batch's shape: graph-safe
            qkv, residual = self.pre_attention(hidden, residual, positions, meta.slot_mapping,
                                               kv_cache, cos_sin_cache, rotate_and_store=False)
            attn_out = attn.rope_store_attend(qkv, positions, meta, kv_cache, cos_sin_cache)
            return self.post_attention(attn_out, residual)
        qkv, residual = self.pre_attention(hidden, residual, positions, meta.slot_mapping,
                                           kv_cache, cos_sin_cache)
        return self.post_attention(attn.attend(qkv, meta, kv_cache), residual)

    def pre_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                      positions: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: KVCache,
                      cos_sin_cache: torch.Tensor, rotate_and_store: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm and q/k/v (rotated and stored unless ``rotate_and_store`` is False: the
        attention does it): returns (qkv, residual)."""
        # The residual add is fused into the next norm; before layer 0 there is none yet.
        # ``residual is None`` depends on the layer index only, never on data.
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            hidden = dispatch.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden, residual = dispatch.fused_add_rms_norm(hidden, residual, norm.weight,
                                                           norm.eps)
        if not rotate_and_store:
            return self.self_attn.qkv_proj(hidden), residual
        qkv = self.self_attn.project_qkv(hidden, positions, slot_mapping, kv_cache,
                                         cos_sin_cache)
        return qkv, residual

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, norm and MLP: returns (hidden, residual)."""
        hidden = self.self_attn.project_out(attn_out)
        norm = self.post_attention_layernorm
        hidden, residual = dispatch.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden), residual

    def forward_gemv(self, stream: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, kv_cache: KVCache, cos_sin_cache: torch.Tensor
                     ) -> torch.Tensor:
        """The same layer for a few rows (``dispatch.GEMV_MAX_ROWS``), one rank: four fused
        GEMVs that stream each weight once, the norms, SiLU and residual adds inside them.
        ``stream`` is the whole residual stream (hidden + residual); returns the next one."""
        attn, mlp = self.self_attn, self.mlp
        norm = self.input_layernorm
        qkv = dispatch.rms_norm_gemv(stream, norm.weight, norm.eps, attn.qkv_proj.weight,
                                     attn.qkv_proj.bias)
        if attn.backend.fuses_rope(meta):  # decided by the batch's shape: graph-safe
            attn_out = attn.rope_store_attend(qkv, positions, meta, kv_cache, cos_sin_cache)
        else:
            qkv = attn.rotate_and_store(qkv, positions, meta.slot_mapping, kv_cache,
                                        cos_sin_cache)
            attn_out = attn.attend(qkv, meta, kv_cache)
        attn_out = attn_out.reshape(-1, attn.q_size)
        stream = dispatch.gemv_add(attn_out, attn.o_proj.weight, attn.o_proj.bias, stream)
        norm = self.post_attention_layernorm
        gate_up = dispatch.rms_norm_gemv(stream, norm.weight, norm.eps, mlp.gate_up_proj.weight,
                                         None)
        return dispatch.silu_mul_gemv_add(gate_up, mlp.down_proj.weight, None, stream)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding``, built without its random init on the meta device (the loader's
    path: weights are loaded or set afterwards). That init imports ``torch._dynamo``
    (torch 2.13: model load 1.2-1.5 s against 0.4-0.5 s on CPU) for values nobody reads."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, backend: AttentionBackend, vocab_rows: int,
                 comm: TPComm = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = _embedding(vocab_rows, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, backend, comm) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, with q/k/v and gate/up fused. ``arch`` is the
    whole model's; ``self.arch`` is this rank's shapes (the same without a ``shard``)."""

    def __init__(self, arch: ModelArch, attn_backend: AttentionBackend,
                 max_positions: int | None = None, shard: TPShard | None = None,
                 comm: TPComm = SINGLE) -> None:
        super().__init__()
        self.shard, self.comm = shard or TPShard(arch), comm
        self.arch = arch = self.shard.rank_arch()
        self.attn_backend = attn_backend
        vocab_rows = self.shard.vocab_per_rank  # the whole vocabulary on one rank
        self.model = LlamaModel(arch, attn_backend, vocab_rows, comm)
        self.lm_head = nn.Linear(arch.hidden_size, vocab_rows, bias=False)
        self.rotary = RotaryEmbedding(arch, max_positions or arch.max_position_embeddings)
        self.tie_weights()
        # Set by the engine (``--decode-gemv on``): at one rank, steps of at most
        # GEMV_MAX_ROWS tokens run ``LlamaDecoderLayer.forward_gemv``.
        self.decode_gemv = False

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head; re-run after moving off the meta device."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return self.model.embed_tokens(input_ids)
        # Each rank looks up the ids in its vocabulary rows, zeros the others; the sum over
        # ranks is the embedding.
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_per_rank)
        hidden = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.comm.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))

    def forward_layers(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                       positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[KVCache], start: int, end: int,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs layers [start, end). Pass ``residual=None`` before layer 0 (fresh embedding)."""
        if self.runs_decode_gemv(hidden):
            return self._forward_layers_gemv(hidden, residual, positions, meta, kv_caches,
                                             start, end)
        cos_sin = self.rotary.cos_sin_cache
        for i in range(start, end):
            layer = self.model.layers[i]
            hidden, residual = layer(hidden, residual, positions, meta, kv_caches[i], cos_sin)
        return hidden, residual

    def runs_decode_gemv(self, hidden: torch.Tensor) -> bool:
        """Whether a step of these rows takes the fused GEMV path: by row count only (never
        by data), so a captured graph always replays the path it recorded. Its ops run
        Triton on a GPU and their torch references elsewhere (the engine allows it on CUDA
        only, where it pays)."""
        return (self.decode_gemv and hidden.shape[0] <= dispatch.GEMV_MAX_ROWS
                and self.comm.size == 1)

    def _forward_layers_gemv(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                             positions: torch.Tensor, meta: AttentionMetadata,
                             kv_caches: list[KVCache], start: int, end: int,
                             ) -> tuple[torch.Tensor, None]:
        """``forward_layers`` on the fused GEMV path; returns (residual stream, None), which
        the next layer range and ``final_norm`` read as a fresh stream."""
        stream = hidden if residual is None else hidden + residual
        cos_sin = self.rotary.cos_sin_cache
        for i in range(start, end):
            stream = self.model.layers[i].forward_gemv(stream, positions, meta, kv_caches[i],
                                                       cos_sin)
        return stream, None

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        norm = self.model.norm
        if residual is None:
            return dispatch.rms_norm(hidden, norm.weight, norm.eps)
        return dispatch.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[KVCache]) -> torch.Tensor:
        """[T] token ids -> [T, hidden] after the final norm."""
        hidden = self.embed(input_ids)
        hidden, residual = self.forward_layers(hidden, None, positions, meta, kv_caches, 0,
                                               self.num_layers)
        return self.final_norm(hidden, residual)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 [N, vocab]; pass only the rows that will be sampled."""
        logits = self.lm_head(hidden_rows)
        if self.comm.size == 1:
            return logits.float()
        # Padding rows past the vocabulary are cut here: they can never be sampled.
        return self.comm.all_gather_rows(logits)[:, :self.arch.vocab_size].float().contiguous()
