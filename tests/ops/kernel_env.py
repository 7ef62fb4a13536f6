"""How the kernel tests run here: compiled on a GPU, or in Triton's interpreter on a
CPU-only machine.

Triton decides at decoration time whether a kernel is interpreted, so the environment
variable must be set before the kernel modules are imported: ``conftest.py`` imports this
module first. Tests import their markers from here (not from ``conftest``, a name several
test folders share).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = HAS_TRITON and not torch.cuda.is_available()

if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from pdserve.ops.interpreter import patch_interpreter

    patch_interpreter()

# Tests that run Triton kernels on CPU tensors through the interpreter.
interpreted = pytest.mark.skipif(
    not INTERPRETED,
    reason="interpreter tests run only without CUDA (the gpu-marked tests cover the GPU)"
    if HAS_TRITON
    else "triton is not installed",
)
