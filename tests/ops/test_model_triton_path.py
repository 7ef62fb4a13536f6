"""The whole model on the Triton path (fused ops + Triton attention, interpreted on CPU)
against the same model on the torch-reference path.

Tolerance (float32): logits within atol 1e-4 + rtol 1e-4 (kernels and reference differ only
in summation order); greedy tokens identical.
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import interpreted

from pdserve.model.arch import PRESETS
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.testing import greedy_step_logits
from pdserve.ops import dispatch
from pdserve.ops.launch_count import count_launches
from pdserve.ops.registry import get_attention_backend

PROMPTS = [[256, 5, 17, 99, 3, 8, 41], [256, 77, 2]]
# The second decode step reads KV that the first wrote on the path under test; a third would
# repeat the second's path, and each interpreted step costs seconds (3 s, 8 s with the GEMV
# on a 2-core host).
DECODE_STEPS = 2


def _logits_over_steps(model: LlamaForCausalLM, steps: int) -> list[torch.Tensor]:
    return greedy_step_logits(model, PROMPTS, steps)


def _model_and_reference_logits(preset: str) -> tuple[LlamaForCausalLM, list[torch.Tensor]]:
    """A tiny model with random norms, its attention switched to Triton after it ran
    ``DECODE_STEPS`` on the torch-reference path (whose logits come back too)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(PRESETS[preset], get_attention_backend("torch", "cpu"))
    model.model.apply(_randomize_norms)
    with dispatch.reference_ops():
        expected = _logits_over_steps(model, steps=DECODE_STEPS)
    model.attn_backend = get_attention_backend("triton", "cpu")
    for layer in model.model.layers:
        layer.self_attn.backend = model.attn_backend
    return model, expected


@pytest.fixture(scope="module")
def fused_rope_run():
    """The default Triton path (the rotary + K/V store inside the decode kernel), its
    interpreted steps run once for the two tests below that check it (each step costs
    seconds in the interpreter): (model, its logits, the reference's, the launches)."""
    # tiny-qwen2: qkv bias and tied embeddings on top of the Llama layout
    model, expected = _model_and_reference_logits("tiny-qwen2")
    model.attn_backend.fuse_rope = True  # the default, whatever the environment says
    with dispatch.interpreted_triton_ops(), count_launches() as count:
        got = _logits_over_steps(model, steps=DECODE_STEPS)
    return model, got, expected, count


@interpreted
def test_model_triton_path_matches_reference_path(fused_rope_run):
    _, got, expected, _ = fused_rope_run
    _assert_logits_match(got, expected)


@interpreted
def test_decode_gemv_path_matches_reference_path(monkeypatch):
    """Decode steps (2 rows) on the fused GEMV path, the prefill (10 rows) on the usual one:
    logits as the reference path's, and the GEMV kernel did run (4 launches per layer), with
    the rotary + K/V store inside the decode kernel (the default; the prefill keeps its own).
    tiny-qwen2 only: the Llama layout plus the qkv bias the GEMV adds (one preset keeps the
    interpreter's time down; the GPU tests run the kernels on the real shapes)."""
    model, expected = _model_and_reference_logits("tiny-qwen2")
    model.decode_gemv = True
    monkeypatch.setattr("pdserve.ops.triton_gemv.GEMV_CONFIGS", _wide_gemv_configs(model))
    with dispatch.interpreted_triton_ops(), count_launches() as count:
        got = _logits_over_steps(model, steps=DECODE_STEPS)
    assert count.by_name["triton::_gemv_kernel"] == DECODE_STEPS * 4 * model.num_layers
    prefills = len(got) - DECODE_STEPS
    assert count.by_name["triton::_rope_store_kv_kernel"] == prefills * model.num_layers
    _assert_logits_match(got, expected)


def _wide_gemv_configs(model: LlamaForCausalLM) -> dict:
    """Each of the model's GEMV shapes (2 rows) with tiles of 64 weight rows: the
    interpreter runs a launch's programs one by one, and the default 8 rows a program made
    2,048 of them. A K tile of 128 also sweeps K in several tiles (the default 512 covers
    tiny-qwen2's K of 256 and 512 in one), so the next-tile loads are exercised."""
    from pdserve.ops.triton_gemv import GemvConfig, row_bucket

    arch, wide = model.arch, GemvConfig(block_n=64, block_k=128)
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    shapes = [(qkv_rows, arch.hidden_size), (arch.hidden_size, arch.num_heads * arch.head_dim),
              (2 * arch.intermediate_size, arch.hidden_size),
              (arch.hidden_size, arch.intermediate_size)]
    return {(n, k, row_bucket(2)): wide for n, k in shapes}


@interpreted
def test_fused_rope_decode_path_matches_reference_path(fused_rope_run):
    """Decode steps with the rotary + K/V store inside the decode kernel: the reference's
    logits, and no ``rope_store_kv`` launch in those steps (the prefill keeps it)."""
    model, got, expected, count = fused_rope_run
    _assert_logits_match(got, expected)
    prefills = len(got) - DECODE_STEPS
    assert count.by_name["triton::_rope_store_kv_kernel"] == prefills * model.num_layers


def _assert_logits_match(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        assert g.argmax(-1).tolist() == e.argmax(-1).tolist()


def _randomize_norms(module: torch.nn.Module) -> None:
    """Norm weights start at one; random ones make a norm bug visible."""
    if hasattr(module, "eps") and hasattr(module, "weight"):
        torch.nn.init.uniform_(module.weight, 0.5, 1.5)
