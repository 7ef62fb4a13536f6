"""``PDSERVE_PDL=1``: programmatic dependent launch for the decode path's Triton kernels,
refused at start-up where the device cannot run it, never silently dropped; off, nothing
changes (the interpreter gets no launch option). That the kernels carry the wait is
checked by compiling them for sm_90 (``sm90_compile.py``)."""

from __future__ import annotations

import pytest
import torch

from pdserve.ops import pdl


@pytest.fixture(autouse=True)
def fresh_cache():
    pdl.pdl_on.cache_clear()
    pdl.pdl_requested_once.cache_clear()
    yield
    pdl.pdl_on.cache_clear()
    pdl.pdl_requested_once.cache_clear()


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert not pdl.pdl_requested()
    pdl.check_pdl(torch.device("cpu"))  # nothing asked: nothing to refuse
    assert not pdl.pdl_on("cuda", 0)
    assert pdl.launch_options(False) == {}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert not pdl.pdl_requested()


def test_asked_on_a_cpu_device_is_refused(monkeypatch):
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    with pytest.raises(ValueError, match="PDSERVE_PDL=1 .* needs a CUDA device"):
        pdl.check_pdl(torch.device("cpu"))
    assert not pdl.uses_pdl(torch.zeros(1))  # CPU tensors never launch with it


def test_asked_before_hopper_is_refused_and_on_hopper_taken(monkeypatch):
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None:
                        capability["value"])
    with pytest.raises(ValueError, match="compute capability 9.0 or later .* has 8.0"):
        pdl.check_pdl(torch.device("cuda"))
    assert not pdl.pdl_on("cuda", 0)
    capability["value"] = (9, 0)
    pdl.pdl_on.cache_clear()
    pdl.check_pdl(torch.device("cuda"))
    assert pdl.pdl_on("cuda", 0)
    assert pdl.launch_options(True) == {"launch_pdl": True}


def test_the_engine_refuses_it_on_a_cpu_device(monkeypatch):
    from pdserve.config import EngineConfig
    from pdserve.engine.core import EngineCore

    monkeypatch.setenv(pdl.PDL_ENV, "1")
    with pytest.raises(ValueError, match="PDSERVE_PDL=1"):
        EngineCore(EngineConfig.from_flat(model="tiny", device="cpu"))


def test_asked_with_a_triton_without_grid_dependency_control_is_refused(monkeypatch):
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    monkeypatch.setattr(pdl, "grid_dependency_control", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="Triton 3.4 or later"):
        pdl.check_pdl(torch.device("cuda"))
    assert not pdl.pdl_on("cuda", 0)
