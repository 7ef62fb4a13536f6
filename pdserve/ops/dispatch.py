"""Fused ops picked by the tensor's device: Triton for CUDA tensors, torch reference otherwise.

The model calls these; it never imports a backend directly.
"""

from __future__ import annotations

from pdserve.ops import reference

rms_norm = reference.rms_norm
fused_add_rms_norm = reference.fused_add_rms_norm
silu_and_mul = reference.silu_and_mul
apply_rope = reference.apply_rope
store_kv = reference.store_kv
