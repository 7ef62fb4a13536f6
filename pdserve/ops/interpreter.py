"""Running Triton kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``).

Used by the kernel tests and by launch counts on machines without a GPU; compiled kernels
never touch this module.
"""

from __future__ import annotations


def patch_interpreter_for_numpy_2_4() -> None:
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
