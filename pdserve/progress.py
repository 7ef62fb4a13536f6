"""Progress bars for the slow start-up steps (weights, graph capture, profiling).

On stderr, and only for a person watching: off when stderr is not a terminal (logs, CI,
pipes) and off with ``pdserve ... --quiet``, which sets ``PDSERVE_QUIET=1`` so that the
engine process and the instances a launcher starts inherit it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

QUIET_ENV = "PDSERVE_QUIET"


def progress_enabled() -> bool:
    return os.environ.get(QUIET_ENV) != "1" and sys.stderr.isatty()


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "",
             unit: str = "it") -> Any:
    """A tqdm bar on stderr (a silent pass-through when progress is off)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr,
                disable=not progress_enabled(), dynamic_ncols=True, leave=False)
