"""The model on a CUDA device in bfloat16 (skipped without a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.model.arch import PRESETS
from pdserve.model.loader import load_model
from pdserve.model.testing import PagedRunner
from pdserve.ops.reference import TorchAttentionBackend

pytestmark = pytest.mark.gpu

# bf16 weights and activations against the fp32 HF model: logits within 0.05 absolute
# (logits here are O(1); bf16 keeps ~3 significant digits through 2 layers).
BF16_ATOL = 5e-2


def test_bf16_on_gpu_close_to_hf_fp32(llama_ckpt):
    folder, hf = llama_ckpt
    model_config = ModelConfig(model=str(folder))
    from pdserve.model.arch import get_arch

    model = load_model(model_config, get_arch(model_config), "cuda", "auto",
                       TorchAttentionBackend())
    assert next(model.parameters()).dtype == torch.bfloat16
    prompt = [256, 5, 17, 99, 3, 8, 41, 300, 12]
    runner = PagedRunner(model, num_blocks=16, block_size=4)
    logits = runner.step([(0, prompt)])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0].cpu(), expected, atol=BF16_ATOL, rtol=0)


@pytest.mark.slow
def test_dummy_codellama_34b_loads_fast_and_runs():
    arch = PRESETS["codellama-34b"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    model = load_model(ModelConfig(model="codellama-34b"), arch, "cuda", "auto",
                       TorchAttentionBackend())
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    assert load_s < 60, f"dummy load took {load_s:.1f} s"
    runner = PagedRunner(model, num_blocks=64, block_size=16)
    prompts = [list(range(1, 200)), list(range(500, 530))]
    logits = runner.step(list(enumerate(prompts)))
    logits = runner.step([(i, [int(t)]) for i, t in enumerate(logits.argmax(-1).tolist())])
    assert torch.isfinite(logits).all()
    print(f"codellama-34b dummy load {load_s:.1f} s")


def _triton_model(folder):
    from pdserve.model.arch import get_arch
    from pdserve.ops.registry import get_attention_backend

    model_config = ModelConfig(model=str(folder))
    return load_model(model_config, get_arch(model_config), "cuda", "auto",
                      get_attention_backend("auto", "cuda"))


@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt"])
def test_triton_prefill_and_decode_close_to_hf(ckpt, request):
    folder, hf = request.getfixturevalue(ckpt)
    model = _triton_model(folder)
    prompts = [[256, 5, 17, 99, 3, 8, 41, 300, 12], [256, 77], list(range(256, 320))]
    runner = PagedRunner(model, num_blocks=64, block_size=16)
    logits = runner.step(list(enumerate(prompts)))
    next_ids = [42, 43, 44]
    logits = runner.step([(i, [t]) for i, t in enumerate(next_ids)])
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([p + [t]])).logits[0, -1]
                                for p, t in zip(prompts, next_ids, strict=True)])
    torch.testing.assert_close(logits.cpu(), expected, atol=BF16_ATOL, rtol=0)


def test_decode_step_replays_from_cuda_graph(llama_ckpt):
    """The forward has no host syncs: a captured decode step replays to the eager result."""
    from pdserve.model.testing import build_metadata

    model = _triton_model(llama_ckpt[0])
    runner = PagedRunner(model, num_blocks=16, block_size=16)
    runner.step([(0, [256, 5, 17, 99]), (1, [256, 7])])
    meta = build_metadata([4, 2], [1, 1], [[1], [2]], 16, "cuda")
    ids = torch.tensor([11, 12], device="cuda")
    positions = torch.tensor([4, 2], device="cuda")
    # Writing the same token's K/V to the same slot again is idempotent, so the eager run,
    # the warm-up and the replay all see the same cache.
    with torch.no_grad():
        eager = model(ids, positions, meta, runner.kv_caches).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(ids, positions, meta, runner.kv_caches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, positions, meta, runner.kv_caches)
    graph.replay()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
