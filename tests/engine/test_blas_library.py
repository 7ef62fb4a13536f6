"""``--blas-library``: torch's default cuBLAS unless asked; cuBLASLt refused off a CUDA device
in one line; on a CUDA device the choice is set for the whole process before any graph."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.config import DeviceConfig, EngineConfig, add_cli_args, engine_config_from_args
from pdserve.engine.model_runner import apply_blas_library


def _config(**device: object) -> EngineConfig:
    return EngineConfig.from_flat(**device)


def test_cublas_by_default_and_cublaslt_from_the_command_line():
    assert _config().device.blas_library == "cublas"
    parser = argparse.ArgumentParser()
    add_cli_args(parser, DeviceConfig)
    assert engine_config_from_args(parser.parse_args(["--blas-library", "cublaslt"])).device \
        .blas_library == "cublaslt"
    with pytest.raises(SystemExit):
        parser.parse_args(["--blas-library", "rocblas"])


def test_cublaslt_is_refused_on_a_cpu_device_and_cublas_is_nothing_to_do():
    apply_blas_library(_config(), torch.device("cpu"))
    with pytest.raises(ValueError, match="--blas-library cublaslt .* needs a CUDA device"):
        apply_blas_library(_config(blas_library="cublaslt"), torch.device("cpu"))
    with pytest.raises(ValueError, match="choose one of cublas, cublaslt"):
        apply_blas_library(_config(blas_library="rocblas"), torch.device("cpu"))


def test_a_cuda_device_gets_the_named_library_and_a_later_engine_can_set_it_back(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", chosen.append)
    apply_blas_library(_config(blas_library="cublaslt"), torch.device("cuda"))
    apply_blas_library(_config(), torch.device("cuda"))
    assert chosen == ["cublaslt", "cublas"]
