"""pdserve's Llama/Qwen2/Qwen3 against Hugging Face transformers on the same random weights.

Tolerance (float32, CPU): logits within atol 1e-4 + rtol 1e-4 of HF's (observed ~1e-6);
greedy tokens identical.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.model.arch import ModelArch
from pdserve.model.llama import rope_cos_sin_cache
from pdserve.model.testing import PagedRunner, build_metadata, greedy_generate

ATOL = RTOL = 1e-4
PROMPTS = [[256, 5, 17, 99, 3, 8, 41, 300, 12], [256, 77], [256, 1, 2, 3, 4, 5],
           [256, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211, 212, 213, 214]]
NEW_TOKENS = 6


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def _hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def pair(request, load_pdserve):
    folder, hf = request.getfixturevalue(f"{request.param}_ckpt")
    return load_pdserve(folder), hf


def test_prefill_batch_logits_match_hf(pair):
    """Mixed-length prompts as one flattened prefill: every position's logits match HF."""
    ours, hf = pair
    runner = PagedRunner(ours, num_blocks=32, block_size=4)
    batch = list(enumerate(PROMPTS))
    hidden = _forward_all(runner, batch)
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32
    expected = torch.cat([_hf_logits(hf, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


def _forward_all(runner: PagedRunner, batch) -> torch.Tensor:
    """Like ``runner.step`` but returns the hidden states of every token."""
    captured = {}
    hook = runner.model.register_forward_hook(lambda m, args, out: captured.setdefault("h", out))
    try:
        runner.step(batch)
    finally:
        hook.remove()
    return captured["h"]


def test_greedy_decode_matches_hf_generate(pair):
    ours, hf = pair
    got = greedy_generate(ours, PROMPTS, NEW_TOKENS, block_size=4)
    assert got == [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def test_decode_logits_match_hf(pair):
    """Decode steps read earlier tokens' K/V from the pages: compare each step's logits."""
    ours, hf = pair
    prompt = PROMPTS[0]
    runner = PagedRunner(ours, num_blocks=16, block_size=4)
    logits = runner.step([("a", prompt)])
    tokens = list(prompt)
    for _ in range(4):
        torch.testing.assert_close(logits[0], _hf_logits(hf, tokens)[-1], atol=ATOL, rtol=RTOL)
        tokens.append(int(logits[0].argmax()))
        logits = runner.step([("a", tokens[-1:])])


def test_mixed_decode_and_chunked_prefill_batch(pair):
    """One step holding a decode, a prefill chunk that extends cached context, a new prompt."""
    ours, hf = pair
    runner = PagedRunner(ours, num_blocks=32, block_size=4)
    long_prompt, short, fresh = PROMPTS[3], PROMPTS[2], PROMPTS[0]
    runner.step([("short", short), ("long", long_prompt[:7])])
    decode_token = 42
    logits = runner.step([("short", [decode_token]), ("long", long_prompt[7:]),
                          ("fresh", fresh)])
    expected = torch.stack([_hf_logits(hf, short + [decode_token])[-1],
                            _hf_logits(hf, long_prompt)[-1], _hf_logits(hf, fresh)[-1]])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=RTOL)


def test_layer_blocks_compose_to_forward(pair):
    """Prefill cut into layer blocks (embed, layers [0,1), [1,L), final norm) == forward."""
    ours, _ = pair
    prompt = PROMPTS[1] + PROMPTS[2]
    whole = PagedRunner(ours, num_blocks=8, block_size=4)
    pieces = PagedRunner(ours, num_blocks=8, block_size=4)
    expected = _forward_all(whole, [(0, prompt)])
    meta, ids, positions = _metadata_for(pieces, prompt)
    hidden = ours.embed(ids)
    hidden, residual = ours.forward_layers(hidden, None, positions, meta, pieces.kv_caches, 0, 1)
    hidden, residual = ours.forward_layers(hidden, residual, positions, meta, pieces.kv_caches,
                                           1, ours.num_layers)
    torch.testing.assert_close(ours.final_norm(hidden, residual), expected, atol=0, rtol=0)


def _metadata_for(runner: PagedRunner, prompt: list[int]):
    pages = list(range(1, 1 + -(-len(prompt) // runner.block_size)))
    meta = build_metadata([0], [len(prompt)], [pages], runner.block_size)
    return meta, torch.tensor(prompt), torch.arange(len(prompt))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_table_matches_hf(rope):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4,
                                      max_position_embeddings=2048,
                                      rope_parameters={"rope_theta": 50000.0, **rope})
    arch = ModelArch.from_hf_config(config.to_dict())
    positions = torch.arange(2048)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    half = arch.head_dim // 2
    ours = rope_cos_sin_cache(arch, 2048, torch.device("cpu"))
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half], atol=0, rtol=0)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half], atol=0, rtol=0)


def test_big_steps_run_the_mlp_in_slices_with_the_same_result(monkeypatch):
    import torch

    from pdserve.model import llama
    from pdserve.model.arch import PRESETS

    torch.manual_seed(0)
    mlp = llama.LlamaMLP(PRESETS["tiny"])
    hidden = torch.randn(300, PRESETS["tiny"].hidden_size)
    whole = mlp(hidden)
    monkeypatch.setattr(llama, "MLP_CHUNK_TOKENS", 64)  # 300 tokens: four full slices + one
    torch.testing.assert_close(mlp(hidden), whole, atol=1e-5, rtol=1e-5)
