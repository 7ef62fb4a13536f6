"""Discrete-event simulators of pdserve's instances, groups and fleets."""

from __future__ import annotations

import importlib

# The modules ``PDSERVE_COMPILE_SIM=1`` compiles with mypyc (setup.py's SIM_MODULES).
HOT_MODULES = ("pdserve.sim.cluster", "pdserve.sim.fleet")


def compiled() -> bool:
    """Whether the simulator's hot modules run compiled: each was imported from a built
    extension (next to its source) rather than from its ``.py`` file."""
    files = [importlib.import_module(name).__file__ or "" for name in HOT_MODULES]
    return all(not f.endswith(".py") for f in files)
