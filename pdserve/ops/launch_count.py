"""Counts the kernels a piece of model code launches, on a GPU or on the CPU.

Two sources are counted while the code runs: every aten op that runs a kernel (GEMMs,
copies, elementwise ops; views and allocations run none) and every Triton kernel launch.
On a CPU, run the Triton path inside ``dispatch.interpreted_triton_ops()`` with
``TRITON_INTERPRET=1``: the interpreter launches the same kernels with the same grids, so
the count is the one a GPU would see from the Python side. What it cannot see: a library
call that launches several kernels (cuBLAS may add a split-K reduction to a GEMM), which
only a GPU profiler shows (``benchmarks/profile_decode.py`` reports both).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# Ops that only allocate or describe memory: no kernel on any device.
_NO_KERNEL_OPS = {"empty", "empty_strided", "empty_like", "lift_fresh"}


@dataclass
class LaunchCount:
    """Kernels launched, by name: ``aten::mm`` for torch ops, ``triton::<kernel>`` for Triton."""

    by_name: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    @property
    def triton(self) -> int:
        return sum(n for name, n in self.by_name.items() if name.startswith("triton::"))

    def per_call(self, calls: int) -> dict[str, float]:
        return {name: n / calls for name, n in sorted(self.by_name.items())}


class _AtenCounter(TorchDispatchMode):
    def __init__(self, count: LaunchCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_KERNEL_OPS:
            self.count.by_name[f"aten::{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches() -> Iterator[LaunchCount]:
    """Within the block, every kernel launch is added to the yielded ``LaunchCount``."""
    count = LaunchCount()
    with _count_triton(count), _AtenCounter(count):
        yield count


def count_calls(fn: Callable[[], Any], calls: int = 1) -> LaunchCount:
    """Runs ``fn`` ``calls`` times and returns the kernels launched over all of them."""
    with count_launches() as count:
        for _ in range(calls):
            fn()
    return count


@contextlib.contextmanager
def _count_triton(count: LaunchCount) -> Iterator[None]:
    """Wraps the launch method of compiled and interpreted Triton kernels, when importable."""
    classes = _triton_kernel_classes()
    originals = [cls.run for cls in classes]

    def wrap(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                count.by_name[f"triton::{self.fn.__name__}"] += 1
            # The interpreter moves tensors with torch ops of its own: not kernel launches.
            with _disable_current_modes():
                return original(self, *args, **kwargs)

        return run

    for cls, original in zip(classes, originals, strict=True):
        cls.run = wrap(original)
    try:
        yield
    finally:
        for cls, original in zip(classes, originals, strict=True):
            cls.run = original


def _triton_kernel_classes() -> list[type]:
    from pdserve.ops.dispatch import triton_available

    if not triton_available():
        return []
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return [JITFunction, InterpretedFunction]
