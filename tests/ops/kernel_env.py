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


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a Python int
    with ``int(array)``, which NumPy 2.4 rejects (triton-lang/triton#9171), so a loop bound
    read from memory fails. Only the interpreter is patched; compiled kernels are untouched.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pdserve_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pdserve_patched = True
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _patch_interpreter_for_numpy_2_4()

# Tests that run Triton kernels on CPU tensors through the interpreter.
interpreted = pytest.mark.skipif(
    not INTERPRETED,
    reason="interpreter tests run only without CUDA (the gpu-marked tests cover the GPU)"
    if HAS_TRITON
    else "triton is not installed",
)
