"""Running Triton kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``).

Used by the kernel tests and by launch counts on machines without a GPU; compiled kernels
never touch this module. Each patch below works around one interpreter bug of a released
Triton, and is harmless on versions without it.
"""

from __future__ import annotations


def patch_interpreter() -> None:
    """Applies every interpreter patch once."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_pdserve_patched", False):
        return
    _patch_scalar_index(interpreter)
    _patch_mask_dtype(interpreter)
    interpreter._pdserve_patched = True


def _patch_scalar_index(interpreter) -> None:
    """Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a Python int
    with ``int(array)``, which NumPy 2.4 rejects (triton-lang/triton#9171), so a loop bound
    read from memory fails."""
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _patch_mask_dtype(interpreter) -> None:
    """Triton 3.9's interpreter computes ``bool_tensor & scalar_bool`` (a mask and-ed with a
    comparison of a loaded scalar) as an integer array, and its load and store then refuse
    the mask ("mask has unsupported dtype"). The values are 0 / 1, so casting back is exact."""
    builder = interpreter.InterpreterBuilder
    original_load, original_store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype == bool:
            return mask
        return interpreter.TensorHandle(mask.data.astype(bool), mask.dtype)

    # The trailing arguments (cache policy, eviction, volatility) differ between versions.
    def masked_load(self, ptrs, mask, *rest):
        return original_load(self, ptrs, as_bool(mask), *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        return original_store(self, ptrs, value, as_bool(mask), *rest)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
