"""``--decode-gemv``: the fused decode-layer form gives the usual layer's logits; the flag is
off by default, and ``on`` is refused in one line where it cannot run."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from pdserve.config import DeviceConfig, EngineConfig, add_cli_args, engine_config_from_args
from pdserve.engine.model_runner import check_decode_gemv
from pdserve.model.arch import PRESETS
from pdserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm
from pdserve.model.testing import greedy_step_logits
from pdserve.ops.dispatch import triton_available
from pdserve.ops.registry import get_attention_backend

PROMPTS = [[256, 5, 17, 99, 3, 8, 41], [256, 77, 2]]


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


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_fused_layer_form_matches_the_usual_one(preset, monkeypatch):
    """``forward_gemv`` on the torch references (the Triton kernels are checked against
    those in tests/ops): decode logits as the usual layer's, prefill (10 rows) unchanged.
    Float32: the two forms differ in rounding order only."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(PRESETS[preset], get_attention_backend("torch", "cpu"))
    for module in model.modules():
        if isinstance(module, RMSNorm):  # norm weights start at one: random ones show bugs
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    expected = greedy_step_logits(model, PROMPTS, steps=3)
    model.decode_gemv = True
    calls = []
    fused = LlamaDecoderLayer.forward_gemv
    monkeypatch.setattr(LlamaDecoderLayer, "forward_gemv",
                        lambda layer, *args: calls.append(1) or fused(layer, *args))
    got = greedy_step_logits(model, PROMPTS, steps=3)
    assert len(calls) == 3 * model.num_layers  # every decode step, never the prefill
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)
    for step, (g, e) in enumerate(zip(got[1:], expected[1:], strict=True), start=1):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        assert g.argmax(-1).tolist() == e.argmax(-1).tolist()


# In bf16 the fused form rounds differently from the usual one, and on random weights the
# logits run to ~250, where bf16's spacing is 1.0: an absolute bound on their difference
# either fails on rounding (0.05 did: 0.25 apart) or passes real errors. Both forms are
# judged instead against the same weights in float32: the fused form's mean error may be at
# most this much the usual form's (0.89-1.07x over 8 seeds on the torch references; an
# attention output 2% too large, 1.37-1.82x).
BF16_ERROR_RATIO = 1.25


def _mean_errors_against_float32(model: LlamaForCausalLM) -> tuple[float, float]:
    """Mean |logit error| of a bf16 model's first decode step against the same weights in
    float32: the usual layer form's, then the fused form's."""
    truth = greedy_step_logits(copy.deepcopy(model).float(), PROMPTS, steps=1)[1]
    usual = greedy_step_logits(model, PROMPTS, steps=1)[1]
    model.decode_gemv = True
    fused = greedy_step_logits(model, PROMPTS, steps=1)[1]
    return (usual - truth).abs().mean().item(), (fused - truth).abs().mean().item()


def test_fused_layer_form_in_bf16_is_as_close_to_float32():
    """The torch references in bf16: the fused form's decode logits are as close to the
    float32 model's as the usual form's."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(PRESETS["tiny-qwen2"], get_attention_backend("torch", "cpu"))
    usual, fused = _mean_errors_against_float32(model.to(torch.bfloat16))
    assert fused <= BF16_ERROR_RATIO * usual, (usual, fused)


@pytest.mark.gpu
def test_fused_layer_form_on_gpu():
    """The Triton GEMVs in the whole model on a GPU, one decode step (both paths then decode
    the same tokens; a later step could follow a near tie apart). Float32: the usual path's
    logits within rounding. Bf16: as close to the float32 model's as the usual path's."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(PRESETS["tiny-qwen2"], get_attention_backend("triton", "cuda"))
    usual, fused = _mean_errors_against_float32(copy.deepcopy(model).to(torch.bfloat16))
    assert fused <= BF16_ERROR_RATIO * usual, (usual, fused)
    expected = greedy_step_logits(model, PROMPTS, steps=1)
    model.decode_gemv = True
    got = greedy_step_logits(model, PROMPTS, steps=1)
    torch.testing.assert_close(got[1], expected[1], atol=1e-3, rtol=0)
