"""``--decode-gemv``: off by default, and ``on`` refused in one line where it cannot run."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.config import DeviceConfig, EngineConfig, add_cli_args, engine_config_from_args
from pdserve.engine.model_runner import check_decode_gemv
from pdserve.ops.dispatch import triton_available


def _config(**device: object) -> EngineConfig:
    return EngineConfig.from_flat(**device)


def test_off_by_default_and_on_from_the_command_line():
    assert _config().device.decode_gemv == "off"
    check_decode_gemv(_config(), torch.device("cpu"))  # off: nothing to refuse anywhere
    parser = argparse.ArgumentParser()
    add_cli_args(parser, DeviceConfig)
    assert engine_config_from_args(parser.parse_args(["--decode-gemv", "on"])).device \
        .decode_gemv == "on"
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-gemv", "maybe"])


def test_unknown_value_is_refused():
    with pytest.raises(ValueError, match="--decode-gemv 'maybe': choose off or on"):
        check_decode_gemv(_config(decode_gemv="maybe"), torch.device("cpu"))


def test_on_is_refused_on_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_decode_gemv(_config(decode_gemv="on"), torch.device("cpu"))


def test_on_is_refused_under_tensor_parallelism():
    config = _config(decode_gemv="on", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1 only"):
        check_decode_gemv(config, torch.device("cuda"))


@pytest.mark.skipif(triton_available(), reason="checks the refusal without triton")
def test_on_is_refused_without_triton():
    with pytest.raises(ValueError, match="triton package"):
        check_decode_gemv(_config(decode_gemv="on"), torch.device("cuda"))
