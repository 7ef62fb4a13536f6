"""Triton kernels compiled after start-up: each one stalled the step that met it.

The warm-up (``engine/warmup.py``) compiles the eager steps' kernels before the server says
it is ready; what it misses, a fresh server compiles inside a serving step, which then
takes tens of times its prediction (on the H200, 7-34x at 6f2d50e). The watch counts those
compiles by kernel, with the constants of the first few, so a run's engine info names what
the warm-up should have covered instead of leaving it to be inferred from slow steps.

It hooks Triton's post-compile callback (``triton.knobs.runtime.jit_post_compile_hook``),
one per process, chaining any hook already there.
"""

from __future__ import annotations

import re

EXAMPLES = 3  # kernels' constants kept per kernel


class CompileWatch:
    """Counts compiles once ``serving()`` was called; before it, the warm-up's are expected."""

    def __init__(self) -> None:
        self.installed = False
        self.why_not: str | None = None
        self.watching = False
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}
        self._previous = None

    def install(self) -> bool:
        """Hooks Triton's post-compile callback; False (and ``why_not``) where it has none."""
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            self.why_not = "this Triton has no knobs.runtime.jit_post_compile_hook"
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            self.why_not = "this Triton has no knobs.runtime.jit_post_compile_hook"
            return False
        try:
            self._previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self
        except Exception as error:  # a Triton whose knobs refuse it: serve unwatched
            self.why_not = f"Triton refused the post-compile hook: {error!r}"
            return False
        self.installed, self.why_not = True, None
        return True

    def serving(self) -> None:
        self.watching = True

    def __call__(self, *args, **kwargs):
        if self.watching:
            self.record(kwargs.get("fn"), kwargs.get("compile") or {}, kwargs.get("repr") or "")
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def record(self, fn, compiled: dict, signature: str = "") -> None:
        name = getattr(fn, "name", None) or "unknown"
        self.counts[name] = self.counts.get(name, 0) + 1
        kept = self.examples.setdefault(name, [])
        if len(kept) < EXAMPLES:
            kept.append(f"{repr(compiled.get('constants', {}))[:300]} "
                        f"{specialised_integers(signature)}".rstrip())

    def describe(self) -> dict:
        if not self.installed:
            return {"watched": False, "why": self.why_not or "not on a CUDA device"}
        return {"watched": True, "compiles": sum(self.counts.values()),
                "by_kernel": dict(sorted(self.counts.items())),
                "constants": dict(sorted(self.examples.items()))}


# ``name: i32D`` (a type with its specialisation) or ``name: ('i32', 'D')`` (Triton versions
# keep the two apart); the letter is empty for a plain integer.
_INTEGER_ARG = re.compile(r"(\w+): (?:\('([iu]\d+)', '(\w*)'\)|([iu]\d+)([A-Z]*)\b)")


def specialised_integers(signature: str) -> str:
    """The integer arguments of Triton's kernel repr (``name[options](arg: type, ...)``)
    with their specialisation: ``i32`` plain, ``i32D`` a multiple of 16 (a value of 1 shows
    among the constants). Two compiles of one kernel with the same constants differ here."""
    args = signature.partition("](")[2]
    return ", ".join(f"{name}: {pair_kind or kind}{pair_spec or spec}"
                     for name, pair_kind, pair_spec, kind, spec in _INTEGER_ARG.findall(args))


WATCH = CompileWatch()  # one per process: Triton has one hook
