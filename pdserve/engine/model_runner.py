"""Owns the model, the KV pool and the decode graphs; runs one plan and samples."""

from __future__ import annotations

import logging
import time

import torch

from pdserve.cache.kv_pool import allocate_kv_pool, bytes_per_block
from pdserve.config import EngineConfig
from pdserve.engine.batch import BlockTables, HostBatch, build_host_batch
from pdserve.engine.graph_runner import GraphRunner
from pdserve.engine.sampler import SamplingBatch, sample, worst_case_sampling
from pdserve.model.arch import ModelArch
from pdserve.model.loader import load_model, resolve_dtype
from pdserve.ops.registry import get_attention_backend
from pdserve.sched.base import Plan, StepOutput

log = logging.getLogger(__name__)
GiB = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, max_model_len: int):
        self.config, self.arch, self.max_model_len = config, arch, max_model_len
        self.device = resolve_device(config.device.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        self.attn_backend = get_attention_backend(config.device.attention_backend, self.device)
        started = time.perf_counter()
        self.model = load_model(config.model, arch, self.device, self.dtype, self.attn_backend)
        log.info("model loaded in %.1f s", time.perf_counter() - started)
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = allocate_kv_pool(arch, self.num_blocks, self.block_size, self.dtype,
                                          self.device)
        self.tables = BlockTables(-(-max_model_len // self.block_size))
        self.graphs = self._capture_graphs()

    # ---- memory ----

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        per_block = bytes_per_block(self.arch, self.block_size, self.dtype)
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type != "cuda":
            return max(1, int(cache.cpu_kv_cache_gb * GiB) // per_block)
        budget = self._cuda_kv_budget()
        num_blocks = int(budget // per_block)
        if num_blocks < -(-self.max_model_len // self.block_size):
            raise RuntimeError(f"KV pool of {num_blocks} blocks cannot hold one request of "
                               f"{self.max_model_len} tokens; raise gpu_memory_utilization")
        log.info("KV pool: %d blocks of %d tokens (%.1f GiB)", num_blocks, self.block_size,
                 num_blocks * per_block / GiB)
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Bytes for KV: the allowed share of the GPU minus what is in use and the peak of a
        largest step (measured by running one), with room for the decode graphs."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free
        peak = self._profile_step_peak()
        graph_reserve = 0 if self.config.device.enforce_eager else 256 << 20
        budget = total * self.config.cache.gpu_memory_utilization - in_use - peak - graph_reserve
        log.info("memory: total %.1f GiB, in use %.1f GiB, step peak %.2f GiB", total / GiB,
                 in_use / GiB, peak / GiB)
        return max(0, int(budget))

    @torch.inference_mode()
    def _profile_step_peak(self) -> int:
        num_tokens = min(largest_step_tokens(self.config.scheduler), self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        scratch = allocate_kv_pool(self.arch, blocks, self.block_size, self.dtype, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        batch = _profile_batch(num_tokens, self.block_size)
        input_ids, positions, meta = batch.metadata(self.device)
        hidden = self.model.forward(input_ids, positions, meta, scratch)
        rows = min(num_tokens, self.config.scheduler.max_num_seqs)
        # Top-k/top-p sampling sorts the whole vocabulary of every row: with a large vocab
        # and a full batch that can outgrow a small step's activations.
        sample(self.model.compute_logits(hidden[-rows:]), worst_case_sampling(rows, self.device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak

    def _capture_graphs(self) -> GraphRunner | None:
        if self.device.type != "cuda" or self.config.device.enforce_eager:
            return None
        if self.config.scheduler.schedule in ("multiplex", "disagg"):
            return None  # these loops capture graphs on their own partitions' streams
        max_batch = min(self.config.device.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)
        runner = GraphRunner(self.model, self.kv_caches, max_batch, self.tables.width,
                             self.block_size, self.device)
        before = torch.cuda.mem_get_info(self.device)[0]
        runner.capture()
        used = before - torch.cuda.mem_get_info(self.device)[0]
        log.info("decode graphs use %.2f GiB", used / GiB)
        return runner

    # ---- a step ----

    @torch.inference_mode()
    def execute(self, plan: Plan) -> StepOutput:
        batch = build_host_batch(plan, self.tables, self.block_size)
        hidden = self._forward(batch)
        rows = torch.from_numpy(batch.logits_indices).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        requests = [s.request for s in plan.sampling]
        sampling = SamplingBatch.from_requests(requests, self.arch.vocab_size, self.device)
        tokens, logprobs = sample(logits, sampling)
        return StepOutput(token_ids=tokens.tolist(),
                          logprobs=logprobs.tolist() if logprobs is not None else None)

    def _forward(self, batch: HostBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        input_ids, positions, meta = batch.metadata(self.device)
        return self.model.forward(input_ids, positions, meta, self.kv_caches)

    def forget(self, request_id: str) -> None:
        self.tables.drop(request_id)


def largest_step_tokens(sched) -> int:
    """Tokens in the largest step the schedule can run: its activations must fit beside the
    KV pool, and reserving for a bigger step than the policy ever makes wastes KV memory."""
    if sched.schedule == "chunked":
        return sched.chunk_size
    if sched.schedule == "prefill-first":
        return sched.max_num_batched_tokens
    return max(sched.max_num_batched_tokens, sched.chunk_size)  # multiplex / disagg


def _profile_batch(num_tokens: int, block_size: int) -> HostBatch:
    import numpy as np

    blocks = -(-num_tokens // block_size)
    positions = np.arange(num_tokens, dtype=np.int64)
    return HostBatch(
        input_ids=np.zeros(num_tokens, dtype=np.int64), positions=positions,
        slot_mapping=positions.copy(), query_start_loc=np.array([0, num_tokens], np.int32),
        seq_lens=np.array([num_tokens], np.int32),
        block_tables=np.arange(blocks, dtype=np.int32)[None, :],
        logits_indices=np.array([num_tokens - 1]), num_decode_seqs=0, block_size=block_size)
