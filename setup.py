"""The package is described in pyproject.toml; this file only adds the opt-in compiled build
of the fleet simulator's hot modules (mypyc, ahead of time, from the same source).

    pip install mypy
    PDSERVE_COMPILE_SIM=1 pip install --no-build-isolation -e .

Without ``PDSERVE_COMPILE_SIM=1`` nothing is compiled: the interpreted modules are the
default and what the tests run.
"""

from __future__ import annotations

import os

from setuptools import setup

# The event loop and everything it calls per request (docs/cluster.md, "Compiled simulator").
SIM_MODULES = ["pdserve/sim/cluster.py", "pdserve/sim/fleet.py"]


def ext_modules() -> list:
    if os.environ.get("PDSERVE_COMPILE_SIM", "0") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as error:  # asked for, so not silently skipped
        raise SystemExit("PDSERVE_COMPILE_SIM=1 needs mypy (pip install mypy) in the "
                         "build environment: pip install --no-build-isolation") from error
    # Only these modules are type-checked: what else mypy reads (the rest of the package
    # and numpy, for types; not their errors) is pyproject.toml's [tool.mypy].
    return mypycify(SIM_MODULES, opt_level="3", group_name="pdserve_sim")


setup(ext_modules=ext_modules())
