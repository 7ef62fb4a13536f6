"""Attention backends by name, imported lazily so a CPU install never imports Triton."""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.ops.dispatch import triton_available, triton_interpreted
from pdserve.ops.metadata import AttentionMetadata

BACKEND_NAMES = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    """``forward`` stores the step's K/V at ``meta.slot_mapping``, then attends over the whole
    context; ``attend`` only attends, for callers that stored K/V themselves (the model does,
    fused with the rotary embedding)."""

    name: str

    def fuses_rope(self, meta: AttentionMetadata) -> bool:
        """Whether the model hands this batch's rotary + K/V store to ``rope_store_attend``
        (Triton, on by default) instead of running ``rope_store_kv`` before ``attend``."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def get_attention_backend(
    name: str, device: torch.device | str, **options: object
) -> AttentionBackend:
    """The backend called ``name``; "auto" is Triton on CUDA when importable, else torch.

    ``options`` go to the Triton backend's constructor (e.g. ``max_kv_splits``); the torch
    backend takes none and ignores them.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKEND_NAMES}")
    if name == "auto":
        if device.type == "cuda" and not triton_available():
            # The torch reference on a GPU is orders of magnitude slower: never by surprise.
            raise RuntimeError("attention backend 'auto' on a CUDA device needs the triton "
                               "package; install it, or ask for --attention-backend torch")
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from pdserve.ops.reference import TorchAttentionBackend

        return TorchAttentionBackend()
    _check_triton_usable(device)
    from pdserve.ops.triton_attention import TritonAttentionBackend

    return TritonAttentionBackend(**options)


def _check_triton_usable(device: torch.device) -> None:
    if not triton_available():
        raise RuntimeError("attention backend 'triton' needs the triton package")
    if device.type != "cuda" and not triton_interpreted():
        raise RuntimeError(
            f"attention backend 'triton' runs on CUDA devices, not {device.type!r} "
            "(set TRITON_INTERPRET=1 before importing triton to run its kernels on CPU)"
        )
