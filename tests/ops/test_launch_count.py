"""Kernel-launch counting, and what one decode layer launches on the Triton path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from kernel_env import interpreted

from pdserve.model.arch import PRESETS
from pdserve.ops import dispatch
from pdserve.ops.launch_count import count_launches

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "count_launches.py"


def _count_script():
    spec = importlib.util.spec_from_file_location("count_launches", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["count_launches"] = module
    spec.loader.exec_module(module)
    return module


def test_counter_counts_kernels_not_views_or_allocations():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with count_launches() as count:
        a.view(8, 4).t()
        torch.empty(5)
        a[1:].reshape(-1)
    assert count.total == 0
    with count_launches() as count:
        a @ b
        a + 1
    assert count.total == 2, count.by_name


def test_interpreted_ops_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"), dispatch.interpreted_triton_ops():
        pass


@interpreted
def test_interpreted_triton_launches_are_counted():
    x, w = torch.randn(3, 16), torch.randn(16)
    with dispatch.interpreted_triton_ops(), count_launches() as count:
        dispatch.rms_norm(x, w, 1e-6)
    assert dict(count.by_name) == {"triton::_rms_norm_kernel": 1}


# Split-KV decode attention: split + reduce.
_ATTENTION = {"triton::_decode_split_kernel": 1, "triton::_decode_reduce_kernel": 1}
_ROPE_STORE = {"triton::_rope_store_kv_kernel": 1}
LAYER_LAUNCHES = {
    # Two norms (residual add fused in), QKV, o_proj, gate/up and down GEMMs, silu-and-mul;
    # rotary and the K/V store run inside the decode split kernel (the default).
    "triton": {"triton::_rms_norm_kernel": 2, "aten::linear": 4,
               "triton::_silu_and_mul_kernel": 1, **_ATTENTION},
    # --decode-gemv on: four fused GEMVs (norms, SiLU and residual adds inside them); no
    # norm, SiLU or cuBLAS launch; rotary and the K/V store in the decode split kernel.
    "gemv": {"triton::_gemv_kernel": 4, **_ATTENTION},
}


@interpreted
@pytest.mark.parametrize("path", ["triton", "gemv"])
@pytest.mark.parametrize("model", ["tiny", "tiny-qwen2"])
def test_decode_layer_launches(model, path):
    script = _count_script()
    count = script.count_decode_layer(PRESETS[model], 3, 40, "cpu", torch.float32, path)
    assert dict(count.by_name) == LAYER_LAUNCHES[path]


@interpreted
def test_unfused_rope_launches_its_own_kernel(monkeypatch):
    """PDSERVE_FUSED_ROPE_DECODE=0 stores K/V and rotates in a kernel of its own."""
    from pdserve.ops.triton_attention import FUSED_ROPE_DECODE_ENV

    monkeypatch.setenv(FUSED_ROPE_DECODE_ENV, "0")
    script = _count_script()
    count = script.count_decode_layer(PRESETS["tiny"], 3, 40, "cpu", torch.float32, "triton")
    assert dict(count.by_name) == {**LAYER_LAUNCHES["triton"], **_ROPE_STORE}


@interpreted
def test_one_launch_decode_drops_the_reduce_kernel(monkeypatch):
    """The opt-in path merges the splits in the split kernel's own launch."""
    from pdserve.ops.triton_attention import ONE_LAUNCH_DECODE_ENV

    monkeypatch.setenv(ONE_LAUNCH_DECODE_ENV, "1")
    script = _count_script()
    count = script.count_decode_layer(PRESETS["tiny"], 3, 40, "cpu", torch.float32, "triton")
    assert count.by_name["triton::_decode_split_kernel"] == 1
    assert "triton::_decode_reduce_kernel" not in count.by_name
    assert count.total == 8


@interpreted
def test_decode_layer_with_one_kv_split_skips_the_reduce(monkeypatch):
    """A decode batch large enough for one KV split per sequence (here 8 sequences x 2 KV
    heads against 2 programs per SM on 8 SMs; 140 sequences on the H200's 132) launches no
    reduce kernel when long contexts are not balanced (PDSERVE_DECODE_BALANCE_SPLITS=1;
    balanced, the grid keeps splits for them and the reduce runs)."""
    from pdserve.ops import triton_attention

    monkeypatch.setattr(triton_attention, "_sm_count", lambda device: 8)
    monkeypatch.setenv(triton_attention.BALANCE_SPLITS_ENV, "1")
    script = _count_script()
    count = script.count_decode_layer(PRESETS["tiny"], 8, 20, "cpu", torch.float32, "triton")
    assert count.by_name["triton::_decode_split_kernel"] == 1
    assert "triton::_decode_reduce_kernel" not in count.by_name
    assert count.total == 8
