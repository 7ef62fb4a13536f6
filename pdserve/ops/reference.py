"""Plain-torch ops: the CPU backend, and the oracle every Triton kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.ops.metadata import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is the next residual."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


def rms_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(rms_norm(x), weight, bias)`` as the fused GEMV computes it: x times the norm
    weight in fp32, the dot products scaled by rsqrt(mean(x^2) + eps), rounded once."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = F.linear(x32 * norm_weight.float(), weight.float()) * inv_rms
    return (out if bias is None else out + bias.float()).to(x.dtype)


def gemv_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor) -> torch.Tensor:
    """``residual + F.linear(x, weight, bias)`` in fp32, rounded once: the new residual."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (out + residual.float()).to(x.dtype)


def silu_mul_gemv_add(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor) -> torch.Tensor:
    """``gemv_add`` of ``silu_and_mul(gate_up)`` (rounded to the activation dtype first)."""
    return gemv_add(silu_and_mul(gate_up), weight, bias, residual)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (HF Llama's rotate_half) on [T, heads, head_dim].

    ``cos_sin_cache`` is [max_position, rotary_dim] float32: cos in the first half, sin in
    the second. Only the first ``rotary_dim`` channels of each head rotate.
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x_pass], dim=-1) if x_pass.numel() else rotated


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes new keys/values ([T, kv_heads, head_dim]) into pages ([pages, block, kv_heads, d])."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = k_cache.shape[1]
    pages, offsets = slots // block_size, slots % block_size
    k_cache[pages, offsets] = k[valid].to(k_cache.dtype)
    v_cache[pages, offsets] = v[valid].to(v_cache.dtype)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """``apply_rope`` on q and k in place, then ``store_kv`` of the rotated k and v."""
    q_rot, k_rot = apply_rope(q, k, positions, cos_sin_cache)
    q.copy_(q_rot)
    k.copy_(k_rot)
    store_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's whole context in the cache.

    q: [T, q_heads, head_dim]. The new tokens' K/V must already be stored. A new token at
    position p (counting from the start of its sequence) sees context positions 0..p.
    """
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i in range(meta.num_seqs):
        q_seq = q[starts[i] : starts[i + 1]]
        out[starts[i] : starts[i + 1]] = _attend_one(
            q_seq, k_cache, v_cache, meta.block_tables[i], seq_lens[i], scale
        )
    return out


def _attend_one(q, k_cache, v_cache, block_table, seq_len, scale):
    block_size = k_cache.shape[1]
    num_pages = (seq_len + block_size - 1) // block_size
    pages = block_table[:num_pages].long()
    k = k_cache[pages].flatten(0, 1)[:seq_len]  # [S, kv_heads, d]
    v = v_cache[pages].flatten(0, 1)[:seq_len]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [heads, S, d]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    qh = q.transpose(0, 1).float()  # [heads, n_new, d]
    n_new = q.shape[0]
    q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    scores = (qh @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)


class TorchAttentionBackend:
    """Stores the step's K/V into the paged cache, then attends over the whole context."""

    name = "torch"

    def fuses_rope(self, meta: AttentionMetadata) -> bool:
        """The model rotates and stores K/V itself for this backend (``rope_store_kv``)."""
        return False

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over the cache, which already holds this step's K/V."""
        return paged_attention(q, k_cache, v_cache, meta, scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale)


def row_argmax(values: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Index of each row's largest value (the first on ties): the greedy token. With
    ``noise`` (Exp(1) draws, same shape) the index of the largest ``values - log(noise)``:
    the Gumbel-max draw from ``softmax(values)``; a ``-inf`` value (a token filtered out)
    stays ``-inf`` whatever its noise, so it is never drawn."""
    if noise is None:
        return values.argmax(dim=-1)
    keys = torch.where(values == float("-inf"), values, values.float() - noise.log())
    return keys.argmax(dim=-1)
