"""Op dispatch and the attention-backend registry: device routing and lazy Triton import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_env import HAS_TRITON, interpreted

from pdserve.ops import dispatch, reference
from pdserve.ops.reference import TorchAttentionBackend
from pdserve.ops.registry import get_attention_backend


def test_cpu_install_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from pdserve.ops import dispatch\n"
        "from pdserve.ops.registry import get_attention_backend\n"
        "x = torch.randn(3, 8)\n"
        "dispatch.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert get_attention_backend('auto', 'cpu').name == 'torch'\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=repo_root, timeout=120)


def test_cpu_tensors_use_reference():
    x, w = torch.randn(4, 16), torch.randn(16)
    assert not dispatch.uses_triton(x)
    torch.testing.assert_close(dispatch.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_reference_ops_context_restores():
    before = dispatch._force_reference
    with dispatch.reference_ops():
        assert dispatch._force_reference
    assert dispatch._force_reference == before


def test_registry_names():
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("torch", torch.device("cpu")), TorchAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


def test_registry_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="triton"):
        get_attention_backend("triton", "cpu")


@interpreted
def test_registry_triton_interpreted():
    backend = get_attention_backend("triton", "cpu", max_kv_splits=8)
    assert backend.name == "triton" and backend.max_kv_splits == 8


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_gpu_routing():
    assert get_attention_backend("auto", "cuda").name == "triton"
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    assert dispatch.uses_triton(x)
    with dispatch.reference_ops():
        assert not dispatch.uses_triton(x)
    assert dispatch.uses_triton(x)
