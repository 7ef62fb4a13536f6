"""Fused ops picked by the tensor's device: Triton for CUDA tensors, torch reference otherwise.

The model calls these; it never imports a backend directly. Triton is imported lazily, on
the first CUDA call, so a CPU install never imports it. Setting ``PDSERVE_REFERENCE_OPS=1``
(or calling ``force_reference_ops(True)``) routes CUDA tensors to the reference too, for
A/B comparisons; ``interpreted_triton_ops()`` routes CPU tensors to the Triton kernels run
by Triton's interpreter, for tests and launch counts without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from types import ModuleType

import torch

from pdserve.ops import reference

REFERENCE_OPS_ENV = "PDSERVE_REFERENCE_OPS"
# The fused GEMVs (``rms_norm_gemv`` and the rest) take at most this many rows: decode
# batches up to 8. Larger batches keep cuBLAS: their GEMMs are no longer pure streaming.
GEMV_MAX_ROWS = 8

_force_reference = os.environ.get(REFERENCE_OPS_ENV, "0") not in ("", "0", "false", "False")
_interpret_on_cpu = False


def force_reference_ops(enabled: bool) -> None:
    """Route every op to the torch reference (True) or back to device dispatch (False)."""
    global _force_reference
    _force_reference = enabled


@contextlib.contextmanager
def reference_ops() -> Iterator[None]:
    """Within the block, every op runs the torch reference."""
    previous = _force_reference
    force_reference_ops(True)
    try:
        yield
    finally:
        force_reference_ops(previous)


@contextlib.contextmanager
def interpreted_triton_ops() -> Iterator[None]:
    """Within the block, ops on CPU tensors run the Triton kernels in Triton's interpreter:
    for tests and launch counts on machines without a GPU. Needs ``TRITON_INTERPRET=1`` set
    before triton is imported (Triton reads it when a kernel module is imported)."""
    global _interpret_on_cpu
    if not (triton_available() and triton_interpreted()):
        raise RuntimeError("interpreted Triton ops need the triton package and "
                           "TRITON_INTERPRET=1 in the environment before triton is imported")
    from pdserve.ops.interpreter import patch_interpreter

    patch_interpreter()
    previous, _interpret_on_cpu = _interpret_on_cpu, True
    try:
        yield
    finally:
        _interpret_on_cpu = previous


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET`` set)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def uses_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs the Triton kernel."""
    on_device = x.is_cuda or (_interpret_on_cpu and x.device.type == "cpu")
    return on_device and not _force_reference and triton_available()


@functools.cache
def _fused() -> ModuleType:
    from pdserve.ops import triton_fused

    return triton_fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if uses_triton(x):
        return _fused().rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum is the next residual."""
    if uses_triton(x):
        return _fused().fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if uses_triton(gate_up):
        return _fused().silu_and_mul(gate_up)
    return reference.silu_and_mul(gate_up)


@functools.cache
def _gemv() -> ModuleType:
    from pdserve.ops import triton_gemv

    return triton_gemv


def rms_norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(rms_norm(x, norm_weight, eps), weight, bias)``; x has at most
    ``GEMV_MAX_ROWS`` rows."""
    backend = _gemv() if uses_triton(x) else reference
    return backend.rms_norm_gemv(x, norm_weight, eps, weight, bias)


def gemv_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor) -> torch.Tensor:
    """``residual + F.linear(x, weight, bias)``: the new residual stream."""
    backend = _gemv() if uses_triton(x) else reference
    return backend.gemv_add(x, weight, bias, residual)


def silu_mul_gemv_add(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor) -> torch.Tensor:
    """``residual + F.linear(silu_and_mul(gate_up), weight, bias)``."""
    backend = _gemv() if uses_triton(gate_up) else reference
    return backend.silu_mul_gemv_add(gate_up, weight, bias, residual)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if uses_triton(q):
        return _fused().apply_rope(q, k, positions, cos_sin_cache)
    return reference.apply_rope(q, k, positions, cos_sin_cache)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if uses_triton(k_cache):
        return _fused().store_kv(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kv(k, v, k_cache, v_cache, slot_mapping)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Rotates q and k in place, then writes k and v into their cache slots (-1: none)."""
    backend = _fused() if uses_triton(q) else reference
    backend.rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)


def row_argmax(values: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Index of each row's largest value, or of ``values - log(noise)`` (the Gumbel-max
    draw) when Exp(1) ``noise`` is given; see ``reference.row_argmax``. Torch's argmax on
    every device: a two-launch Triton argmax measured 0.05-0.1 ms slower per sampling call
    on the H200 (``benchmarks/results/sampler_h200_llama3_8b_*_argmax_38d366f.json``)."""
    return reference.row_argmax(values, noise)
