"""Tensor parallelism on two GPUs (NCCL): decode CUDA graphs with the all-reduces inside,
captured per SM partition. Only a machine with two or more GPUs runs these."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from tests.parallel.conftest import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 8, 41, 120, 12], [1, 77], [9, 200, 201, 202, 203, 204, 205]]


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("schedule", ["chunked", "multiplex", "disagg"])
def test_tp2_graphs_equal_transformers(gqa_ckpt, schedule):
    folder, hf = gqa_ckpt
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    llm = LLM(folder, dtype="float32", device="cuda", attention_backend="triton",
              tensor_parallel_size=2, schedule=schedule, mux_predictor="roofline",
              allow_emulated_partitions=True, gpu_memory_utilization=0.3)
    try:
        engine = llm.engine
        graphs = engine.runner.pools[engine.scheduler.decode_pool].graphs
        if schedule == "chunked":
            assert set(graphs) == {None}, "whole-GPU decode graphs"
        else:  # one set per partition, each holding its decode lane's all-reduces
            assert len(graphs) == len(engine.scheduler.graph_partitions())
        assert _generate(llm) == want
    finally:
        llm.engine.close()
