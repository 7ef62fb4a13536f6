"""Signals in a server made of several processes."""

from __future__ import annotations

import signal


def ignore_group_signals() -> None:
    """For a server's processes other than the first HTTP process (the engine, its
    tensor-parallel ranks, the other HTTP processes): Ctrl-C, systemd's default stop and
    ``kill -- -PGID`` signal the whole process group, and an engine that left at once would
    lose every request the server is draining. The first HTTP process alone decides when each
    of them stops (a message, a closed channel, or a signal of its own)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def die_with_parent() -> None:
    """``preexec_fn`` of a child that must stop (SIGTERM: a drain) when the process that
    started it dies, even killed, although no group signal reaches it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's stop still ends it on a clean shutdown
