"""The start-up warm-up of eager steps leaves the engine as it found it."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdserve.engine.llm import LLM
from pdserve.engine.warmup import (
    SHAPES,
    decode_split_batches,
    eager_decode_batches,
    extend_split_chunks,
    run_shapes,
    shapes,
    skip_reason,
)
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(40 + 9 * i)] for i in range(4)]


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("schedule", ["chunked", "multiplex"])
def test_warm_up_runs_every_shape_and_gives_everything_back(schedule):
    options = dict(device="cpu", schedule=schedule, chunk_size=64, max_num_batched_tokens=64,
                   mux_predictor="roofline")
    expected = _tokens(LLM("tiny", **options))
    llm = LLM("tiny", **options)
    engine = llm.engine
    free = engine.blocks.num_free_blocks
    planned = shapes(engine, 33)
    assert planned[:len(SHAPES)] == list(SHAPES) and len(planned) > len(SHAPES)
    ran = run_shapes(engine, 33, planned)  # 33 + 1 or 3 decode rows: no multiple of 16
    assert ran["steps"] == len(planned) and ran["prompt_tokens"] == 33
    assert engine.blocks.num_free_blocks == free and not engine.requests
    assert not engine.runner.tables._rows  # no block-table row left behind
    if schedule == "multiplex":
        assert engine.timeline() == []  # the planner never saw them
    assert _tokens(llm) == expected


def test_decode_only_steps_give_everything_back():
    """A decode-only shape (prefix None) runs the decodes alone and leaves the engine as
    it found it, as the mixed shapes do."""
    llm = LLM("tiny", device="cpu", chunk_size=64, max_num_batched_tokens=64)
    expected = _tokens(llm)
    engine = llm.engine
    free = engine.blocks.num_free_blocks
    ran = run_shapes(engine, 33, [(3, None), (1, 0), (17, None)])
    assert ran["steps"] == 3
    assert engine.blocks.num_free_blocks == free and not engine.requests
    assert _tokens(llm) == expected


def test_decode_batches_past_the_graphs_get_a_decode_only_step():
    """Decode-only batches past the largest decode graph run eagerly with the rotary fused
    into attention: each variant met there gets a step (codellama-34b heads, 132 SMs). With
    the default 256 requests the graphs serve every batch; with 512, 257 (2 splits,
    balanced 512 wide) and 265 (1 split) run eagerly; with graphs off, every variant."""
    from pdserve.ops.triton_attention import TritonAttentionBackend

    backend, cpu = TritonAttentionBackend(num_sms=132, balance_splits=8), torch.device("cpu")
    assert eager_decode_batches(backend, 8, cpu, 256, 256) == []
    assert eager_decode_batches(backend, 8, cpu, 256, 512) == [257, 265]
    assert eager_decode_batches(backend, 8, cpu, 0, 256) == decode_split_batches(backend, 8,
                                                                                 cpu, 256)
    assert eager_decode_batches(object(), 8, cpu, 0, 256) == []


def test_where_it_does_not_run_it_says_why():
    assert "device" in skip_reason(LLM("tiny", device="cpu").engine)
    disagg = LLM("tiny", device="cpu", schedule="disagg", allow_emulated_partitions=True)
    disagg.engine.runner.device = type("D", (), {"type": "cuda"})()  # past the device check
    assert "no whole-GPU steps" in skip_reason(disagg.engine)


@pytest.mark.parametrize("balance, first_batches",
                         [(1, [1, 3, 5, 9, 17, 33]),
                          (8, [1, 3, 5, 9, 17, 33, 65, 67, 129, 133])])
def test_every_decode_split_count_gets_a_warm_up_batch(balance, first_batches):
    """codellama-34b (8 kv heads) on 132 SMs: the smallest batch of each kernel variant
    launched (with long contexts balanced: 8 splits from 5 decodes on, 4 from 67, 2 from
    133, balanced from 9 with the lengths loaded 16, 32, ... 256 wide). The first mixed
    steps that stalled on fresh 6f2d50e servers ran beside 3, 5, 6, 9, 10, 17, 18, 19, 33,
    124 and 135 decodes: each shares its kernel variant with a warmed batch."""
    # Imported here, not at collection: Triton decides whether a kernel is interpreted when
    # its module is imported, and tests/ops sets that up while it is collected.
    from pdserve.ops.triton_attention import TritonAttentionBackend

    backend = TritonAttentionBackend(num_sms=132, balance_splits=balance)
    cpu = torch.device("cpu")
    batches = decode_split_batches(backend, 8, cpu, 256)
    assert batches == first_batches
    warmed = {backend.decode_variant(n, 8, cpu) for n in batches}
    stalled = (3, 5, 6, 9, 10, 17, 18, 19, 33, 124, 135)
    assert {backend.decode_variant(n, 8, cpu) for n in stalled} <= warmed
    assert {backend.decode_variant(n, 8, cpu) for n in range(1, 257)} == warmed
    assert decode_split_batches(object(), 8, cpu, 256) == []  # a backend without splits


@pytest.mark.gpu
def test_with_graphs_off_serving_compiles_no_decode_attention_on_gpu():
    """With graphs off every decode batch runs eagerly, decode-only ones with the rotary
    fused into attention: after the warm-up, serving 40 requests whose decode batch
    shrinks one request at a time from 40 to 1 compiles no decode attention kernel."""
    llm = LLM("tiny", device="cuda", attention_backend="triton", enforce_eager=True,
              max_num_seqs=48)
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(rng.randrange(5, 60))]}
               for _ in range(40)]
    params = [SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True)
              for i in range(40)]
    # The watch is one per process: engines of earlier tests may have counted compiles.
    before = _decode_compiles(llm)
    llm.generate(prompts, params)
    assert _decode_compiles(llm) == before, llm.engine.describe()["kernels_compiled_while_serving"]


@pytest.mark.gpu
def test_serving_compiles_no_extend_kernel_after_the_warm_up_on_gpu():
    """With the tail launch (the GPU default), prompts of 5-300 tokens, a long one split in
    chunks behind its own prefix, compile no extend attention kernel while serving: the
    warm-up met every variant they launch (the tiny model packs 2 q heads a kv head)."""
    llm = LLM("tiny", device="cuda", attention_backend="triton", chunk_size=192,
              max_num_batched_tokens=192)
    rng = random.Random(5)
    lengths = [5, 17, 63, 64, 65, 129, 191, 193, 300, 1500]
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(n)]} for n in lengths]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    before = _kernel_compiles(llm, "_extend")
    llm.generate(prompts, params)
    assert _kernel_compiles(llm, "_extend") == before, \
        llm.engine.describe()["kernels_compiled_while_serving"]


def _kernel_compiles(llm: LLM, prefix: str) -> dict[str, int]:
    compiled = llm.engine.describe()["kernels_compiled_while_serving"]
    assert compiled["watched"], compiled
    return {name: count for name, count in compiled["by_kernel"].items()
            if name.startswith(prefix)}


def _decode_compiles(llm: LLM) -> dict[str, int]:
    return _kernel_compiles(llm, "_decode")


@pytest.mark.parametrize("heads, head_dim", [(64, 128), (32, 128), (8, 64)])
def test_every_extend_split_count_gets_a_warm_up_chunk(heads, head_dim):
    """With the auto rule, each prefix split count it launches (codellama-34b's, llama3-8b's
    and a small model's q heads on 132 SMs, the GPU's tiles, and on the prefill SMs of
    multiplexing's partitions) gets one chunk that launches it, on the whole GPU where it
    can; chunks of any size behind any prefix meet no other count. Fixed splits: none.
    One launch a chunk (no tail launch)."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from pdserve.ops.triton_attention import default_extend_config, extend_kv_splits

    gpu = default_extend_config(head_dim, torch.device("cuda"), hopper=True)
    # whatever PDSERVE_EXTEND_KV_SPLITS says; the tail launch's variants: the next test
    fixed = dataclasses.replace(gpu, kv_splits=1, tail_tiles=False)
    tiles = dataclasses.replace(gpu, kv_splits=0, tail_tiles=False)
    cpu, longest, most = torch.device("cpu"), 24576, 8192  # the CPU counts 132 SMs
    arch = SimpleNamespace(num_heads=heads, num_kv_heads=8, head_dim=head_dim)
    assert fixed.kv_splits == 1 and extend_split_chunks(arch, cpu, longest, most, fixed) == []
    assert extend_split_chunks(arch, cpu, longest, most) == []  # the interpreter's tiles
    programs = lambda chunk: -(-chunk // tiles.block_m) * heads
    # Programs follow the tile count: each count's shortest chunk, behind every prefix.
    shortest = range(1, most, tiles.block_m)
    met_on = lambda sms: {extend_kv_splits(0, programs(chunk), prefix, cpu, sms)
                          for chunk in shortest for prefix in range(0, longest - chunk, 64)}
    partitions = [60, 84, 108]
    chunks = extend_split_chunks(arch, cpu, longest, most, tiles, partition_sms=partitions)
    warmed = [extend_kv_splits(0, programs(c), p, cpu, sms) for c, p, sms in chunks]
    assert len(set(warmed)) == len(warmed) and 1 not in warmed
    assert all(chunk < most and chunk + prefix <= longest for chunk, prefix, _ in chunks)
    whole = met_on(None)
    assert all(sms is None for (_, _, sms), splits in zip(chunks, warmed, strict=True)
               if splits in whole)
    met = whole.union(*(met_on(sms) for sms in partitions))
    assert met - {1} == set(warmed) and warmed  # codellama-34b: 2 only; 8 heads: 2-8


@pytest.mark.parametrize("heads, kv_heads", [(64, 8), (32, 8)])
def test_with_the_tail_launch_every_variant_gets_a_warm_up_chunk(heads, kv_heads):
    """With the tail launch (codellama-34b's and llama3-8b's heads, the GPU's tiles, auto
    splits), each (q heads per tile row block, split count) pair that chunks of any size
    behind any prefix launch, on the whole GPU or a partition's prefill SMs, is met by a
    warm-up chunk, and each warm-up chunk meets one pair no earlier chunk met."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from pdserve.ops.triton_attention import (
        LaunchShape,
        default_extend_config,
        plan_extend_launches,
    )

    gpu = default_extend_config(128, torch.device("cuda"), hopper=True)
    tiles = dataclasses.replace(gpu, kv_splits=0, tail_tiles=True)
    cpu, longest, most, partitions = torch.device("cpu"), 24576, 2048, [84, 108]
    arch = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=128)
    group = heads // kv_heads

    def variants(chunk, prefix, sms):
        shape = LaunchShape(heads, 1, prefix, cpu, sms)
        return {(x.row_heads, x.splits) for x in plan_extend_launches(tiles, chunk, group, shape)}

    chunks = extend_split_chunks(arch, cpu, longest, most, tiles, partition_sms=partitions)
    seen = {(1, 1)}
    for chunk, prefix, sms in chunks:
        met = variants(chunk, prefix, sms)
        assert not met <= seen and chunk < most and chunk + prefix <= longest
        seen |= met
    every = {pair for sms in (None, *partitions) for chunk in range(1, most, 3)
             for prefix in range(0, longest - chunk, 512) for pair in variants(chunk, prefix, sms)}
    assert every == seen and (group, 8) in seen


def test_the_engine_records_its_extend_kernel_config():
    """``describe()`` names the prompt-attention kernel's config where Triton runs it (the
    tail launch among its options), and None for the torch reference."""
    from types import SimpleNamespace

    from pdserve.engine.core import EngineCore

    assert LLM("tiny", device="cpu").engine.describe()["extend_kernel"] is None
    pytest.importorskip("triton")
    from pdserve.ops.triton_attention import default_extend_config

    cpu = torch.device("cpu")
    engine = SimpleNamespace(runner=SimpleNamespace(attn_backend=SimpleNamespace(name="triton"),
                                                    device=cpu),
                             arch=SimpleNamespace(head_dim=64))
    described = EngineCore._describe_extend_kernel(engine)
    assert described == dataclasses.asdict(default_extend_config(64, cpu))
    assert described["tail_tiles"] is False and described["kv_splits"] == 1  # interpreter
