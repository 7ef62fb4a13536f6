"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (opt-in:
``PDSERVE_PDL=1``; Hopper and later).

Inside a decode graph every kernel node waits for the one before it to finish and then pays
its own launch (about a microsecond a node on the H200; ~0.4 ms of a codellama-34b batch-1
step). Launched with PDL, a kernel may be scheduled while its predecessor still runs; it
waits at its first statement (``gdc_wait``) until the predecessor has finished and its
writes are visible, so the launch overlaps the predecessor's tail and nothing is read
early; right after the wait it lets its own dependents launch
(``gdc_launch_dependents``), so a Triton kernel after it (the split kernel's reduce) starts
early in turn. The kernels that take it call both under their ``PDL`` constexpr and are
launched with ``launch_options``. A request for it that this device or this Triton cannot
honour is refused at start-up (``check_pdl``), never dropped.
"""

from __future__ import annotations

import functools
import os

import torch

PDL_ENV = "PDSERVE_PDL"
PDL_MIN_CAPABILITY = 9  # griddepcontrol: sm_90 and later


def pdl_requested() -> bool:
    return os.environ.get(PDL_ENV, "0") not in ("", "0")


def check_pdl(device: torch.device) -> None:
    """Refuses ``PDSERVE_PDL=1`` where programmatic dependent launch cannot run."""
    if not pdl_requested():
        return
    if device.type != "cuda":
        raise ValueError(f"{PDL_ENV}=1 launches Triton kernels with programmatic dependent "
                         f"launch: it needs a CUDA device (device {device.type!r})")
    if not grid_dependency_control():
        raise ValueError(f"{PDL_ENV}=1 needs Triton's grid dependency control "
                         "(triton.language.extra.cuda.gdc_wait, Triton 3.4 or later)")
    major, minor = torch.cuda.get_device_capability(device)
    if major < PDL_MIN_CAPABILITY:
        raise ValueError(f"{PDL_ENV}=1 needs compute capability {PDL_MIN_CAPABILITY}.0 or "
                         f"later (Hopper); this GPU has {major}.{minor}")


def grid_dependency_control() -> bool:
    """Whether the installed Triton has ``gdc_wait`` (3.4 and later). Asked only once PDL
    is requested: a CPU engine never imports Triton."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def pdl_on(device_type: str, index: int | None) -> bool:
    """Whether kernels on this device launch with PDL (the environment read once)."""
    if device_type != "cuda" or not pdl_requested() or not grid_dependency_control():
        return False
    return torch.cuda.get_device_capability(index)[0] >= PDL_MIN_CAPABILITY


def uses_pdl(x: torch.Tensor) -> bool:
    """Per kernel launch (eager steps too): off, it costs one cached look-up."""
    return pdl_requested_once() and pdl_on(x.device.type, x.device.index)


@functools.cache
def pdl_requested_once() -> bool:
    return pdl_requested()


def launch_options(pdl: bool) -> dict:
    """The launch keyword that turns PDL on (none when off: the interpreter takes none)."""
    return {"launch_pdl": True} if pdl else {}
