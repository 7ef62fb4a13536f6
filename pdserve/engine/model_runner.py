"""Owns the model, the KV pages and the decode graphs; launches work and samples.

One execution path: ``launch(work, waits, buffers) -> Launch``. A whole batch (decode
graphs when the batch is pure decode and a graph fits, else eager) and a layer-range piece
of a prefill batch are variants of one launch; every launch ends by copying its sampled
tokens to a pinned buffer and recording an event. Synchronous policies launch and wait.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.cache.kv_pool import allocate_kv_pool, bytes_per_block
from pdserve.config import BLAS_LIBRARIES, EngineConfig
from pdserve.dist.comm import SINGLE, TPComm
from pdserve.dist.shard import TPShard
from pdserve.engine.batch import BlockTables, HostBatch, build_host_batch, resolve_placeholders
from pdserve.engine.graph_runner import GraphRunner, batch_buckets
from pdserve.engine.launch import (
    HostBuffers,
    KVPool,
    Launch,
    PrefillBatch,
    PromptRows,
    SamplingInputs,
    sample_into,
)
from pdserve.engine.piecewise import PiecewiseGraphs
from pdserve.engine.sampler import sample, worst_case_sampling
from pdserve.engine.setup import parse_ints
from pdserve.engine.streams import Event, StreamOps, make_stream_ops
from pdserve.engine.tp import TPLeader, check_tp_config
from pdserve.gpu.partitions import Partition
from pdserve.model.arch import ModelArch
from pdserve.model.loader import load_model, resolve_dtype
from pdserve.ops.dispatch import GEMV_MAX_ROWS, triton_available
from pdserve.ops.pdl import check_pdl
from pdserve.ops.registry import get_attention_backend
from pdserve.sched.base import MAIN_POOL, KVMove, Plan, StepOutput, Work

log = logging.getLogger(__name__)
GiB = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_decode_gemv(config: EngineConfig, device: torch.device) -> None:
    """Refuses ``--decode-gemv on`` where its Triton kernels cannot run (a CPU device, no
    triton) or at several ranks (its residual add sits before o_proj's all-reduce)."""
    device_config = config.device
    if device_config.decode_gemv not in ("off", "on"):
        raise ValueError(f"--decode-gemv {device_config.decode_gemv!r}: choose off or on")
    if device_config.decode_gemv == "off":
        return
    if device_config.tensor_parallel_size > 1:
        raise ValueError("--decode-gemv on runs at --tensor-parallel-size 1 only")
    if device.type != "cuda" or not triton_available():
        raise ValueError("--decode-gemv on runs Triton kernels: it needs a CUDA device and the "
                         f"triton package (device {device.type!r})")


def apply_blas_library(config: EngineConfig, device: torch.device) -> None:
    """Points torch's linear layers at the BLAS ``--blas-library`` names. The choice is
    process-wide and made before any graph is captured, so every lane's graphs and eager
    steps run the same kernels; cuBLASLt is refused off a CUDA device rather than ignored."""
    name = config.device.blas_library
    if name not in BLAS_LIBRARIES:
        raise ValueError(f"--blas-library {name!r}: choose one of {', '.join(BLAS_LIBRARIES)}")
    if device.type != "cuda":
        if name != "cublas":
            raise ValueError(f"--blas-library {name} picks a CUDA BLAS: it needs a CUDA device "
                             f"(device {device.type!r})")
        return
    torch.backends.cuda.preferred_blas_library(name)


def rank_device(name: str, rank: int) -> torch.device:
    """Tensor-parallel rank ``rank``'s device: the GPU ``rank`` places after rank 0's."""
    device = resolve_device(name)
    if device.type != "cuda" or rank == 0:
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class ModelRunner:
    """``comm``: given to a tensor-parallel worker; rank 0 starts its workers itself."""

    def __init__(self, config: EngineConfig, arch: ModelArch, max_model_len: int,
                 ops: StreamOps | None = None, comm: TPComm | None = None):
        self.config, self.arch, self.max_model_len = config, arch, max_model_len
        self.device = resolve_device(config.device.device)
        self.tp: TPLeader | None = None
        if comm is None:
            check_tp_config(config, arch)  # one line, before any worker or weight
            check_decode_gemv(config, self.device)
        apply_blas_library(config, self.device)  # each rank's process, before its graphs
        check_pdl(self.device)
        if comm is None and config.device.tensor_parallel_size > 1:
            self.tp = TPLeader(config, arch, max_model_len, self.device)
        self.comm = comm or (self.tp.comm if self.tp else SINGLE)
        self.ops = ops or make_stream_ops(self.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        self.attn_backend = get_attention_backend(config.device.attention_backend, self.device)
        started = time.perf_counter()
        self.model = load_model(config.model, arch, self.device, self.dtype, self.attn_backend,
                                TPShard(arch, self.comm.rank, self.comm.size), self.comm)
        log.info("model loaded in %.1f s", time.perf_counter() - started)
        self.model.decode_gemv = config.device.decode_gemv == "on"
        log.info("decode layers: %s", self.decode_layers)
        # Every rank holds the same pages (of its own KV heads): as many as the fullest fits.
        self.num_blocks = self.comm.agree_min(self._decide_num_blocks())
        self.kv_caches = allocate_kv_pool(self.model.arch, self.num_blocks, self.block_size,
                                          self.dtype, self.device)
        self.pools = {MAIN_POOL: KVPool(self.kv_caches, self._new_tables())}

    @property
    def decode_layers(self) -> str:
        """Which decode-layer path runs: for the start-up log and for results to record."""
        blas = "cuBLASLt" if self.config.device.blas_library == "cublaslt" else "cuBLAS"
        if self.model.decode_gemv:
            return f"fused Triton GEMVs for steps of <= {GEMV_MAX_ROWS} tokens, {blas} above"
        return f"{blas} GEMMs with separate norm and SiLU kernels (--decode-gemv off)"

    def _new_tables(self) -> BlockTables:
        return BlockTables(-(-self.max_model_len // self.block_size))

    @property
    def tables(self) -> BlockTables:
        return self.pools[MAIN_POOL].tables

    def configure(self, layout: dict[str, tuple[int, int]], decode_pool: str,
                  graph_partitions: list[Partition] | None) -> None:
        """Cuts the pages into the policy's pools and captures its decode graphs over
        ``decode_pool``."""
        if self.tp is not None:  # the workers capture theirs at the same time
            self.tp.configure(layout, decode_pool, graph_partitions)
        if set(layout) != {MAIN_POOL}:
            self.pools = {name: KVPool(page_range(self.kv_caches, start, count),
                                       self._new_tables())
                          for name, (start, count) in layout.items()}
        with self.comm.on_lane("decode"):  # graphs hold the decode lane's collectives
            if graph_partitions is None:
                self._capture_whole_gpu_graphs(self.pools[decode_pool])
            else:
                self._capture_partition_graphs(self.pools[decode_pool], graph_partitions)
        if set(layout) == {MAIN_POOL}:  # split pools (disagg) never run a whole-GPU prefill
            self._capture_piecewise_graphs(self.pools[MAIN_POOL])

    # ---- memory ----

    def _decide_num_blocks(self) -> int:
        cache = self.config.cache
        per_block = bytes_per_block(self.model.arch, self.block_size, self.dtype)
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
        graph_reserve = 0 if self.config.device.enforce_eager else (256 << 20) + \
            self._piecewise_reserve()
        budget = total * self.config.cache.gpu_memory_utilization - in_use - peak - graph_reserve
        log.info("memory: total %.1f GiB, in use %.1f GiB, step peak %.2f GiB", total / GiB,
                 in_use / GiB, peak / GiB)
        return max(0, int(budget))

    @torch.inference_mode()
    def _profile_step_peak(self) -> int:
        num_tokens = min(largest_step_tokens(self.config.scheduler), self.max_model_len)
        blocks = -(-num_tokens // self.block_size)
        scratch = allocate_kv_pool(self.model.arch, blocks, self.block_size, self.dtype,
                                   self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        batch = _profile_batch(num_tokens, self.block_size)
        input_ids, positions, meta = batch.metadata(self.device)
        hidden = self.model.forward(input_ids, positions, meta, scratch)
        rows = min(num_tokens, self.config.scheduler.max_num_seqs)
        # Top-p sampling sorts the whole vocabulary of every row and penalties add [rows, vocab]
        # tensors: with a large vocab and a full batch that can outgrow a small step's
        # activations.
        sample(self.model.compute_logits(hidden[-rows:]),
               worst_case_sampling(rows, self.arch.vocab_size, self.device))
        # Prompt logprobs: [256, vocab] float32 logits per pass, more than a small batch's.
        PromptRows.worst_case(num_tokens, self.device).score(self.model, hidden)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak

    def _graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and not self.config.device.enforce_eager

    def _capture_whole_gpu_graphs(self, pool: KVPool) -> None:
        if not self._graphs_enabled():
            return
        max_batch = min(self.config.device.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)
        graphs = GraphRunner(self.model, pool.kv_caches, max_batch, pool.tables.width,
                             self.block_size, self.device)
        before = torch.cuda.mem_get_info(self.device)[0]
        graphs.capture()
        used = before - torch.cuda.mem_get_info(self.device)[0]
        log.info("decode graphs use %.2f GiB", used / GiB)
        pool.graphs[None] = graphs

    def piecewise_tokens(self) -> int:
        """Largest whole-GPU step with prompt tokens replayed from graphs (0: none)."""
        return self._piecewise_tokens()

    def _piecewise_tokens(self) -> int:
        # Under tensor parallelism the segments would hold collectives of the lane that
        # runs the step; not captured there yet (such steps run eagerly).
        if not self._graphs_enabled() or self.comm.size > 1:
            return 0
        return min(self.config.device.piecewise_graph_max_tokens,
                   largest_step_tokens(self.config.scheduler))

    def _piecewise_reserve(self) -> int:
        """Bytes the prefill-step graphs hold: their static buffers and the largest
        segment's activations (the MLP's), with a quarter more for the allocator."""
        tokens, arch = self._piecewise_tokens(), self.arch
        width = 3 * arch.intermediate_size + 7 * arch.hidden_size + 2 * arch.q_size + \
            4 * arch.kv_size
        return int(1.25 * tokens * width * self.dtype.itemsize)

    def _capture_piecewise_graphs(self, pool: KVPool) -> None:
        tokens = self._piecewise_tokens()
        if tokens <= 0:
            return
        graphs = PiecewiseGraphs(self.model, pool.kv_caches, tokens, self.device)
        before = torch.cuda.mem_get_info(self.device)[0]
        graphs.capture()
        used = before - torch.cuda.mem_get_info(self.device)[0]
        log.info("prefill step graphs (up to %d tokens) use %.2f GiB", tokens, used / GiB)
        pool.piecewise = graphs

    def _capture_partition_graphs(self, pool: KVPool, partitions: list[Partition]) -> None:
        """One graph set per partition, captured on its own decode stream (a graph keeps the
        SM limit of the stream it was captured on), all in one memory pool."""
        if not self._graphs_enabled() or not graph_buckets(self.config):
            return
        memory = torch.cuda.graph_pool_handle()
        for part in partitions:
            buckets = graph_buckets(self.config, part.whole_gpu)
            graphs = GraphRunner(self.model, pool.kv_caches, max(buckets), pool.tables.width,
                                 self.block_size, self.device, stream=part.decode_stream,
                                 pool=memory)
            graphs.buckets = list(buckets)  # replay picks among the captured buckets only
            graphs.capture(buckets)
            pool.graphs[part.decode_sms] = graphs
            log.info("decode graphs on %d SMs: batches %s", part.decode_sms, buckets)

    # ---- launching ----

    def launch(self, work: Work, waits: list[Event], buffers: HostBuffers) -> Launch:
        """Issues ``work`` on its stream after ``waits``; returns without waiting for it.
        Under tensor parallelism rank 0 first sends it to the workers, which issue the same."""
        if self.tp is None:  # one rank, or a worker (whose follower picks the lane)
            return self._issue(work, waits, buffers)
        self.tp.send_launch(work, waits)
        with self.comm.on_lane(work.side), self.tp.in_step():
            launch = self._issue(work, waits, buffers)
        self.tp.launched(launch.event)
        return launch

    @torch.inference_mode()
    def _issue(self, work: Work, waits: list[Event], buffers: HostBuffers) -> Launch:
        started = time.perf_counter()
        stream = _stream_of(work)
        with self.ops.on(stream):
            for event in waits:
                self.ops.wait(stream, event)
            start = None
            if work.layers is None:
                start = self.ops.timed_record(stream) if work.timed else None
                num, want = self._launch_whole(work, buffers)
                event = self.ops.timed_record(stream) if start is not None else \
                    self.ops.record(stream)
            else:
                num, want, event = self._launch_piece(work, stream, buffers)
        # ``issued`` is when the host began: an eager step's kernel launches are part of the
        # time between two of its tokens (a mixed step measured from after its launch read
        # 52 ms where requests saw 84 ms per token on the H200).
        return Launch(work, event, buffers, num, want, (time.perf_counter() - started) * 1e3,
                      issued=started, device_start=start)

    def _launch_whole(self, work: Work, buffers: HostBuffers) -> tuple[int, bool]:
        pool = self.pools[work.pool]
        batch = build_host_batch(work.plan, pool.tables, self.block_size)
        inputs = SamplingInputs.of(work.plan, batch, self.arch.vocab_size,
                                   self.device)
        hidden, work.path = self._forward(batch, pool, work.partition, buffers.device_tokens,
                                          _launch_sms(work))
        return sample_into(self.model, hidden, inputs, buffers)

    def _launch_piece(self, work: Work, stream, buffers: HostBuffers) -> tuple[int, bool, Event]:
        carry = work.carry
        if carry.state is None:
            carry.state = PrefillBatch(work.plan, self, self.pools[work.pool])
        result = carry.state.launch_piece(stream, work.layers, work.final, buffers,
                                          _launch_sms(work))
        if work.final:
            carry.state = None
        return result

    def _forward(self, batch: HostBatch, pool: KVPool, part: Partition | None,
                 sampled: torch.Tensor | None, launch_sms: int | None = None
                 ) -> tuple[torch.Tensor, str]:
        """The hidden states, and the path that ran them (``Work.path``). ``sampled``: the
        lane's last sampled tokens, which placeholder ids name; ``launch_sms``: the SMs of
        the partition side it runs on (None: the whole device)."""
        graphs = pool.graphs.get(part.decode_sms if part is not None else None)
        if graphs is not None and graphs.can_run(batch):
            return graphs.run(batch, sampled), "decode_graph"
        input_ids, positions, meta = batch.metadata(self.device, launch_sms)
        whole_gpu = part is None or part.whole_gpu
        if whole_gpu and pool.piecewise is not None and pool.piecewise.can_run(batch):
            return pool.piecewise.run(batch, meta, sampled), "piecewise_graph"
        if batch.has_placeholders:
            input_ids = resolve_placeholders(input_ids, sampled)
        return self.model.forward(input_ids, positions, meta, pool.kv_caches), "eager"

    def sampled_tokens_buffer(self) -> torch.Tensor:
        """A lane's device copy of its sampled tokens (see ``HostBuffers.device_tokens``)."""
        return torch.zeros(self.config.scheduler.max_num_seqs, dtype=torch.int64,
                           device=self.device)

    def execute(self, plan: Plan, buffers: HostBuffers | None = None,
                partition: Partition | None = None) -> StepOutput:
        """Runs ``plan`` on the whole GPU (or on ``partition``'s prefill SMs) and waits for
        its tokens (profiling, warm-up, tests)."""
        buffers = buffers or HostBuffers.make(self.ops, max(1, len(plan.sampling)))
        work = Work(plan) if partition is None else Work(plan, partition, side="prefill")
        launch = self.launch(work, [], buffers)
        launch.event.synchronize()
        return launch.output()

    def forget(self, request_id: str) -> None:
        for pool in self.pools.values():
            pool.tables.drop(request_id)
        if self.tp is not None:
            self.tp.forget(request_id)

    def note_move(self, move: KVMove) -> None:
        """A KV move between this engine's pools: the workers repeat it on their shards."""
        if self.tp is not None:
            self.tp.note_move(move)

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any."""
        if self.tp is not None:
            self.tp.close()


def _launch_sms(work: Work) -> int | None:
    """The SMs ``work`` runs on where that is a partition's side, not the whole device."""
    part = work.partition
    if part is None or part.whole_gpu:
        return None
    return part.decode_sms if work.side == "decode" else part.prefill_sms


def _stream_of(work: Work):
    part = work.partition
    if part is None:
        return None
    return part.decode_stream if work.side == "decode" else part.prefill_stream


def page_range(kv_caches: list, start: int, count: int) -> list:
    """Pages [start, start + count) of every layer: views, no new memory."""
    return [(k[start:start + count], v[start:start + count]) for k, v in kv_caches]


def graph_buckets(config: EngineConfig, whole_gpu: bool = False) -> list[int]:
    """Decode batch sizes captured on a partition: on an SM split the few of
    ``--mux-graph-batches`` (one set per split); on the whole GPU every 16, as the other
    schedules capture. A batch replays its bucket's graph at the bucket's cost: on the H200
    multiplexing's whole-GPU decode steps of 129-191 requests, padded to 192, took 31-32 ms
    where 26 ms ran at 103-119 (ShareGPT-like, 3fa127d)."""
    if config.device.enforce_eager:
        return []
    most = min(config.device.cuda_graph_max_batch, config.scheduler.max_num_seqs)
    if whole_gpu:
        return batch_buckets(most)
    buckets = [b for b in parse_ints(config.scheduler.mux_graph_batches) if b <= most]
    return sorted(set(buckets) | {most}) if buckets else [most]


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
