"""Engine configuration: frozen dataclasses, one per layer, each field documented.

The field docs (``doc(...)``) are also the command line's ``--help``; unknown keys are an
error, so a typo in ``LLM(..., gpu_memory_utilisation=0.9)`` fails loudly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
from dataclasses import dataclass, field
from typing import Any

# How multiplexing's per-option prefill corrections learn (``OnlineCalibration``).
PIECE_RULES = ("compounding", "converging")  # the prefill correction rules learning from pieces
PREFILL_RULES = (*PIECE_RULES, "delivery")
# The order waiting prompts are admitted in (pdserve/sched/prefill_order.py).
PREFILL_ORDERS = ("fcfs", "slo", "priority")
BLAS_LIBRARIES = ("cublas", "cublaslt")  # torch's CUDA BLAS backends
# The TTFT pressure may plan steps past the ITL target, by at most this share: a TPOT SLO is
# a request's mean, and on the H200 chunked 512's ShareGPT-like steps ran ~1.05x it while
# requests' TPOT P99 stayed near it (decode-only steps between bursts run at ~20 ms).
MAX_TTFT_PRESSED_MARGIN = 1.5
# The multiplex defaults since the H200 goodput probes at f67d252 (docs/results.md, "The TPOT
# bank to 2x with the splits starting at 1.3"): with them multiplexing matched or passed the
# best baseline's goodput on the LooGLE-like, ShareGPT-like and Mooncake workloads.
DEFAULT_TTFT_PRESSED_MARGIN = 1.05
DEFAULT_TPOT_BANK_QUANTILE = 0.05


def doc(default: Any, help: str, **kwargs) -> Any:
    """A dataclass field whose help text the CLI reads."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass(frozen=True)
class ModelConfig:
    model: str = doc("tiny", "Preset name (tiny, tiny-qwen2, llama3-8b, codellama-34b, "
                     "llama3.1-70b), a Hugging Face checkpoint folder, or a Hugging Face hub "
                     "id (org/name; downloaded once into the hub cache).")
    revision: str | None = doc(None, "Hub id only: branch, tag or commit to load "
                               "(default: main).")
    download_dir: str | None = doc(None, "Hub id only: cache folder for downloads "
                                   "(default: $HF_HUB_CACHE or ~/.cache/huggingface/hub).")
    dtype: str = doc("auto", "Weights and activations: auto (bfloat16 on GPU, float32 on CPU), "
                     "bfloat16, float16, float32.")
    load_format: str = doc("auto", "auto (safetensors for a folder, dummy for a preset), "
                           "safetensors, or dummy (random weights on the real shapes).",
                           choices=("auto", "safetensors", "dummy"))
    tokenizer: str | None = doc(None, "Tokenizer folder or hub id; defaults to the model "
                                "folder, or a byte-level tokenizer when there is none.")
    generation_config: str = doc("auto", "Request defaults (temperature, top_p, top_k, "
                                 "max_tokens) when a request sets none: auto (the model's "
                                 "generation_config.json), vllm (pdserve's own defaults), or a "
                                 "folder holding a generation_config.json.")
    max_model_len: int | None = doc(None, "Longest context (prompt + output) accepted; "
                                    "defaults to the model's own limit.")
    seed: int = doc(0, "Seed for dummy weights and for requests that give no seed.")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = doc(16, "Tokens per KV page.")
    gpu_memory_utilization: float = doc(0.85, "Share of the GPU's memory the engine may use "
                                        "(weights, KV pool, activations, CUDA graphs).")
    num_blocks: int | None = doc(None, "Force the KV pool to this many pages (tests).")
    cpu_kv_cache_gb: float = doc(0.5, "KV pool size on CPU, in GiB.")
    enable_prefix_caching: bool = doc(True, "Reuse KV pages of identical prompt prefixes.")


@dataclass(frozen=True)
class SchedulerConfig:
    schedule: str = doc("chunked", "prefill-first | chunked | multiplex | disagg.",
                        choices=("prefill-first", "chunked", "multiplex", "disagg"))
    max_num_seqs: int = doc(256, "Most requests running at once.")
    max_num_batched_tokens: int = doc(8192, "prefill-first: most new tokens in one step.")
    chunk_size: int = doc(512, "chunked: token budget per step, decodes included "
                          "(Sarathi-Serve).")
    max_waiting: int = doc(4096, "Requests queued beyond this are refused (HTTP 429).")
    overlap_schedule: bool = doc(True, "Plan and issue the next step while the device runs "
                                 "this one, its sampled tokens passed on the device (one step "
                                 "late stop checks, never a token past a stop). Every step of "
                                 "prefill-first and chunked, the decode and mixed steps of "
                                 "multiplex, the decode steps of disagg; steps with penalties "
                                 "or a grammar, and multiplex's time-slice steps run "
                                 "synchronously (counted in /v1/engine/info).")
    itl_slo_ms: float = doc(60.0, "multiplex: inter-token latency target.")
    ttft_slo_ms: float | None = doc(None, "Time-to-first-token target, if any: the deadline "
                                    "of --prefill-order slo; multiplex also caps a new "
                                    "prefill batch's tokens by the slack of the prompt it "
                                    "serves first.")
    prefill_order: str = doc("fcfs", "Order waiting prompts are admitted in, every policy: "
                             "fcfs (arrival), or slo (needs --ttft-slo-ms): most prompts "
                             "within their TTFT deadline first (Moore-Hodgson over a prefill "
                             "rate learned from the engine's launches), the ones that cannot "
                             "make it after them, never dropped; or priority: by each "
                             "request's priority (lower first, as vLLM's --scheduling-policy "
                             "priority), then arrival.", choices=PREFILL_ORDERS)
    prefill_order_max_wait_ms: float | None = doc(
        None, "--prefill-order slo: a prompt that has waited this long goes ahead of every "
        "prompt that has not, in arrival order (default: no bound; under sustained overload "
        "a prompt the order puts last can wait until the queue drains).")
    mux_decode_sms: str = doc("16,24,32,48,64", "multiplex: decode SM counts to build "
                              "partitions and capture decode graphs for (comma-separated; "
                              "the whole GPU is always offered).")
    mux_graph_batches: str = doc("1,2,4,8,16,32,48,64,96,128,192,256", "multiplex: decode "
                                 "batch sizes captured as graphs on every SM split (the "
                                 "whole GPU captures every 16 up to --cuda-graph-max-batch, "
                                 "as the other schedules do); larger batches run eagerly.")
    mux_sharing: str = doc("temporal,spatial", "multiplex: the ways of sharing "
                           "the GPU the planner weighs at each decode step (comma-separated): "
                           "temporal (whole-GPU mixed steps), time_slice (decode alone, then a "
                           "prefill layer range sized to the rest of the ITL budget; opt-in: "
                           "on the H200 its batches delivered less prefill than mixed steps "
                           "in every run where both ran), spatial (decode and prefill at once "
                           "on their own SM partitions).")
    mux_itl_margin: float = doc(0.9, "multiplex: the share of the ITL target a plan aims at "
                                "(room for predictor error and jitter), in (0, 1].")
    mux_token_align: int = doc(64, "multiplex: mixed-step chunks and spatial prefill batches "
                               "are multiples of this many tokens (or what is left of a "
                               "prompt): coarse sizes follow the GEMM tiles, fine ones fill "
                               "the ITL budget more closely.")
    mux_align_step_tokens: bool = doc(False, "multiplex: align the whole mixed step (the "
                                      "chunk and the decode batch's tokens) to "
                                      "--mux-token-align, as chunked prefill's token budget "
                                      "does, instead of the chunk alone (the mixed-step "
                                      "floor's chunk rounded down to such a step).")
    mux_switch_margin: float = doc(0.03, "multiplex: how much more prefill (as a fraction) "
                                   "another sharing option must be predicted to deliver, after "
                                   "paying for the switch, before the running one is left.")
    mux_graph_step_tokens: int | None = doc(None, "multiplex: weigh mixed steps that fit the "
                                            "prefill-step graphs (prompt and decode tokens up "
                                            "to this many; match --piecewise-graph-max-tokens "
                                            "at most) as an option of their own, at a cost "
                                            "learned from such steps; 0: off. Default: the "
                                            "graphs' size where they are captured (a GPU "
                                            "without tensor parallelism or --enforce-eager), "
                                            "else off.")
    mux_mixed_floor_tokens: int = doc(256, "multiplex: the smallest chunk a mixed step takes "
                                      "while that many prompt tokens wait, even where a "
                                      "smaller one would fit the ITL budget, as long as the "
                                      "step stays within 1.25x the ITL target (else the "
                                      "largest chunk under it that does; kept on the "
                                      "prefill-step graphs when graph steps are on): the SLO "
                                      "is a mean over a request's tokens, and chunks cut "
                                      "small over long prefixes prefill slowly. 0: off.")
    mux_mixed_floor_cap: float = doc(1.25, "multiplex: the longest step the mixed floor may "
                                     "take, as a multiple of --itl-slo-ms (the floor's chunk "
                                     "shrinks to what fits under it). Must be > 0.")
    mux_floor_off_graphs: bool = doc(False, "multiplex: where the floor is cut to what the "
                                     "prefill-step graphs hold beside the decode batch, take "
                                     "the whole floor as an eager step instead when that is "
                                     "predicted to prefill faster within 1.25x the ITL target "
                                     "(a large decode batch otherwise leaves a graph step of "
                                     "a few prompt tokens once eager steps are priced over "
                                     "the budget).")
    mux_reweigh_spatial_batches: bool = doc(True, "multiplex: before the next prefill "
                                            "batch starts beside a decode step running on a "
                                            "partition, weigh every option (mixed steps "
                                            "included) against that partition's, and let the "
                                            "lanes drain for a switch when another wins by the "
                                            "switch margin. Off: that batch is weighed among "
                                            "the partition's own spatial option only, so a "
                                            "busy decode lane can keep prefill on a partition "
                                            "long after mixed steps would deliver more.")
    mux_tpot_bank_cap: float = doc(2.0, "multiplex: let a mixed step or a time slice run past "
                                   "the ITL budget by what every running request has banked "
                                   "against it (the budget times its output tokens, less the "
                                   "time since its first token), up to this multiple of "
                                   "--itl-slo-ms (>= 1; 0: off, every step within the "
                                   "budget). For a TPOT SLO, a mean per request: decode-only "
                                   "steps bank what larger prefill chunks then spend.")
    mux_tpot_bank_quantile: float | None = doc(
        None, "multiplex, with --mux-tpot-bank-cap: spend the bank of the request at this "
        "quantile of the decode batch's banks instead of the tightest's (in [0, 1); 0: the "
        "tightest, every request kept within). An SLO to be met by nine requests in ten may "
        "leave the tenth with the least banked, e.g. one that just joined, over it. "
        "Default: 0.05 with the bank on.")
    mux_ttft_pressed_margin: float | None = doc(None, "multiplex: while a waiting prompt is "
                                         "predicted to miss --ttft-slo-ms at the prefill "
                                         "rate of mixed steps planned to --mux-itl-margin, "
                                         "plan mixed steps and time slices to this share of "
                                         "--itl-slo-ms instead (in [--mux-itl-margin, 1.5]; "
                                         "0: off; past 1 a step runs over the ITL target, "
                                         "which a TPOT SLO, a request's mean, can absorb "
                                         "where decode-only steps run short). Needs "
                                         "--ttft-slo-ms; default: 1.05 with "
                                         "--ttft-slo-ms, off without.")
    mux_prefill_correction: str = doc("converging", "multiplex: how each sharing option's "
                                      "prefill correction learns from its pieces: "
                                      "'converging' moves it towards their measured over "
                                      "predicted time, as the mixed-step correction does; "
                                      "'compounding' moves it by every piece's ratio (it "
                                      "drifts to a bound while pieces run a few percent off "
                                      "the profile); "
                                      "'delivery' learns instead from each batch's prompt "
                                      "tokens over its wall time, first piece to last, against "
                                      "the rate it was chosen by (what happens between pieces "
                                      "included).",
                                      choices=PREFILL_RULES)
    mux_correction_window: int = doc(0, "multiplex: each online correction (mixed steps, "
                                     "co-running decode, each option's prefill) is the median "
                                     "of its last N measured over profiled times, so a short "
                                     "run of slow steps moves none of them (overrides "
                                     "--mux-prefill-correction; 0: off, the moving rules).")
    mux_correction_half_life: int = doc(0, "multiplex: an online correction not observed "
                                        "relaxes towards the profile, its deviation halving "
                                        "over N observations of the others, so an option a "
                                        "few slow steps priced out is tried again (0: off).")
    mux_stall_ratio: float = doc(0.0, "multiplex: a step or piece that took more than this "
                                 "many times its prediction is a stall (kernels compiled on "
                                 "first use, a host pause), not its option's rate: no "
                                 "correction learns from it (> 1; 0: off).")
    mux_co_running_correction: float = doc(
        1.3, "multiplex: the prefill correction SM splits and time slices start from (what "
        "their batches are expected to take over the profile's time; the planner divides "
        "their rates by it until serving teaches it otherwise); 1.0: the profile's rates. "
        "On the H200 such batches delivered 0.67-0.95 of the rate they were chosen by "
        "(docs/results.md).")
    mux_allow_unprofiled: bool = doc(False, "multiplex: answer the SM splits a fitted profile "
                                      "never timed with the roofline model, instead of "
                                      "stopping at start-up with the groups it lacks.")
    mux_predictor: str | None = doc(None, "multiplex: latency predictor JSON from `pdserve "
                                    "profile`, or a folder of them keyed by GPU and model "
                                    "(default: $PDSERVE_PROFILE_DIR or ~/.cache/pdserve/"
                                    "profiles), or 'roofline' for the analytic model. On a GPU a "
                                    "missing or mismatched profile stops start-up.")
    disagg_decode_sms: int | None = doc(None, "disagg: SMs of the decode partition (rounded "
                                        "to the driver's granularity; default: 40 percent of the "
                                        "GPU's SMs); prefill gets the rest.")
    disagg_prefill_kv_fraction: float = doc(0.3, "disagg: share of the KV pages given to the "
                                            "prefill pool (prompts and the prefix cache); "
                                            "the decode pool gets the rest.")

    def __post_init__(self) -> None:
        mux_sharing_options(self.mux_sharing)  # a typo stops here, before anything loads
        check_prefill_order(self.prefill_order, self.ttft_slo_ms,
                            self.prefill_order_max_wait_ms)
        if not 0.0 < self.mux_itl_margin <= 1.0:
            raise ValueError(f"--mux-itl-margin {self.mux_itl_margin}: must be in (0, 1]")
        if self.mux_switch_margin < 0.0:
            raise ValueError(f"--mux-switch-margin {self.mux_switch_margin}: must be >= 0")
        if self.mux_prefill_correction not in PREFILL_RULES:
            raise ValueError(f"--mux-prefill-correction {self.mux_prefill_correction}: "
                             f"expected one of {', '.join(PREFILL_RULES)}")
        if self.mux_correction_window < 0:
            raise ValueError(f"--mux-correction-window {self.mux_correction_window}: must be "
                             ">= 0 (0: off)")
        if self.mux_correction_half_life < 0:
            raise ValueError(f"--mux-correction-half-life {self.mux_correction_half_life}: "
                             "must be >= 0 (0: off)")
        if self.mux_stall_ratio != 0.0 and self.mux_stall_ratio <= 1.0:
            raise ValueError(f"--mux-stall-ratio {self.mux_stall_ratio}: must be > 1 (0: off)")
        if not 0.5 <= self.mux_co_running_correction <= 2.0:
            raise ValueError(f"--mux-co-running-correction {self.mux_co_running_correction}: "
                             "must be within a correction's bounds, [0.5, 2]")
        if self.mux_graph_step_tokens is not None and self.mux_graph_step_tokens < 0:
            raise ValueError(f"--mux-graph-step-tokens {self.mux_graph_step_tokens}: must be "
                             ">= 0")
        if not 1 <= self.mux_token_align <= 512:
            raise ValueError(f"--mux-token-align {self.mux_token_align}: must be in [1, 512]")
        if self.mux_mixed_floor_tokens < 0:
            raise ValueError(f"--mux-mixed-floor-tokens {self.mux_mixed_floor_tokens}: must "
                             "be >= 0")
        if not 0.0 < self.mux_mixed_floor_cap < math.inf:
            raise ValueError(f"--mux-mixed-floor-cap {self.mux_mixed_floor_cap}: must be > 0 "
                             "(a multiple of --itl-slo-ms)")
        if self.mux_tpot_bank_cap != 0.0 and not self.mux_tpot_bank_cap >= 1.0:
            raise ValueError(f"--mux-tpot-bank-cap {self.mux_tpot_bank_cap}: must be 0 (off) "
                             "or >= 1 (a multiple of --itl-slo-ms)")
        self._check_tpot_bank_quantile()
        self._check_ttft_pressed_margin()

    def tpot_bank_quantile(self) -> float:
        """The bank quantile in force: as set, or by default
        ``DEFAULT_TPOT_BANK_QUANTILE`` with the bank on and 0 with it off."""
        if self.mux_tpot_bank_quantile is not None:
            return self.mux_tpot_bank_quantile
        return DEFAULT_TPOT_BANK_QUANTILE if self.mux_tpot_bank_cap else 0.0

    def _check_tpot_bank_quantile(self) -> None:
        quantile = self.mux_tpot_bank_quantile
        if quantile is None:
            return
        if not 0.0 <= quantile < 1.0:
            raise ValueError(f"--mux-tpot-bank-quantile {quantile}: must be in [0, 1)")
        if quantile > 0.0 and self.mux_tpot_bank_cap == 0.0:
            raise ValueError("--mux-tpot-bank-quantile needs --mux-tpot-bank-cap (the bank "
                             "is off without it)")

    def ttft_pressed_margin(self) -> float:
        """The pressed margin in force: as set, or by default ``DEFAULT_TTFT_PRESSED_MARGIN``
        where a TTFT SLO is set and off (0) where none is."""
        if self.mux_ttft_pressed_margin is not None:
            return self.mux_ttft_pressed_margin
        if self.ttft_slo_ms is None or self.ttft_slo_ms <= 0:
            return 0.0
        return DEFAULT_TTFT_PRESSED_MARGIN

    def _check_ttft_pressed_margin(self) -> None:
        margin = self.mux_ttft_pressed_margin
        if margin is None or margin == 0.0:
            return
        if not self.mux_itl_margin <= margin <= MAX_TTFT_PRESSED_MARGIN:
            raise ValueError(f"--mux-ttft-pressed-margin {margin}: must be 0 (off) or in "
                             f"[--mux-itl-margin ({self.mux_itl_margin}), "
                             f"{MAX_TTFT_PRESSED_MARGIN:g}]")
        if self.ttft_slo_ms is None or self.ttft_slo_ms <= 0:
            raise ValueError("--mux-ttft-pressed-margin plans by the TTFT SLO: set "
                             "--ttft-slo-ms to a positive target")


def check_prefill_order(order: str, ttft_slo_ms: float | None,
                        max_wait_ms: float | None = None) -> None:
    """A ValueError naming what is wrong with ``--prefill-order`` and its wait bound."""
    if order not in PREFILL_ORDERS:
        raise ValueError(f"--prefill-order {order!r}: expected one of {', '.join(PREFILL_ORDERS)}")
    if order == "slo" and (ttft_slo_ms is None or ttft_slo_ms <= 0):
        raise ValueError("--prefill-order slo orders prompts by their TTFT deadline: set "
                         "--ttft-slo-ms to a positive target")
    if max_wait_ms is None:
        return
    if order != "slo":
        raise ValueError("--prefill-order-max-wait-ms bounds the wait of the slo order: set "
                         "--prefill-order slo (first come, first served needs no bound)")
    if not max_wait_ms > 0:
        raise ValueError(f"--prefill-order-max-wait-ms {max_wait_ms:g}: must be positive")


MUX_SHARING = ("temporal", "time_slice", "spatial")
# Multiplex defaults through c704437 (time slices opt-in and the converging prefill rule the
# default after it): what a run that named neither flag ran until then (replays and
# benchmark configurations keep their records' meaning by naming them).
EARLIER_DEFAULTS = {"--mux-sharing": "temporal,time_slice,spatial",
                    "--mux-prefill-correction": "compounding"}
# Multiplex defaults through 8a6ad63 (the TPOT bank, the reweighing, TTFT pressure and the
# co-running start were opt-in): by the engine's own report where a record has it.
EARLIER_PLANNER_DEFAULTS = {"--mux-tpot-bank-cap": ("tpot_bank_cap", 0.0),
                            "--mux-tpot-bank-quantile": ("tpot_bank_quantile", 0.0),
                            "--mux-ttft-pressed-margin": ("ttft_pressed_margin", 0.0),
                            "--mux-co-running-correction": ("co_running_start", 1.0),
                            "--mux-reweigh-spatial-batches": ("reweigh_spatial_batches", False)}


def ran_explicitly(server_args: str, engine: dict | None = None) -> str:
    """``server_args`` with the multiplex flags whose defaults changed added where they are
    not named: as the engine reported running them (``engine``, the multiplex engine's
    ``describe()``: its sharing options, planner settings and calibration), else the
    defaults of the time (``EARLIER_DEFAULTS``, ``EARLIER_PLANNER_DEFAULTS``), so a replay
    or a benchmark configuration keeps a record's meaning whatever the defaults are now."""
    engine = engine or {}
    reported = {**engine, **(engine.get("calibration") or {})}
    ran = {"--mux-sharing": ",".join(engine.get("sharing") or []),
           "--mux-prefill-correction": reported.get("prefill_rule")}
    named = {part.split("=")[0].replace("--no-", "--") for part in shlex.split(server_args)}
    missing = [f"{flag} {ran[flag] or earlier}" for flag, earlier in EARLIER_DEFAULTS.items()
               if flag not in named]
    for flag, (key, earlier) in EARLIER_PLANNER_DEFAULTS.items():
        if flag in named:
            continue
        value = reported.get(key, earlier)
        if isinstance(earlier, bool):
            missing.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            missing.append(f"{flag} {float(value):g}")
    return " ".join([server_args, *missing])


def mux_sharing_options(text: str) -> frozenset[str]:
    """The sharing options named in ``--mux-sharing``; a ValueError naming what is wrong."""
    names = {part.strip() for part in str(text).split(",") if part.strip()}
    unknown = sorted(names - set(MUX_SHARING))
    if unknown or not names:
        raise ValueError(f"--mux-sharing {text!r}: name one or more of {', '.join(MUX_SHARING)}"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return frozenset(names)


@dataclass(frozen=True)
class DeviceConfig:
    device: str = doc("auto", "auto (cuda when present), cuda, or cpu.")
    attention_backend: str = doc("auto", "auto (triton on GPU, torch on CPU), triton, torch.",
                                 choices=("auto", "triton", "torch"))
    enforce_eager: bool = doc(False, "Never use CUDA graphs.")
    decode_gemv: str = doc("off", "on: steps of at most 8 tokens (decode batches up to 8) run "
                           "each layer as four fused Triton GEMVs that stream every weight once "
                           "(RMSNorm, SiLU-and-mul and residual adds inside them, no split-K) "
                           "instead of cuBLAS GEMMs and separate small kernels; larger steps "
                           "keep cuBLAS. Needs a CUDA device with Triton and "
                           "--tensor-parallel-size 1. Experimental: slower than cuBLAS on the "
                           "H200 (docs/architecture.md).", choices=("off", "on"))
    blas_library: str = doc("cublas", "Which CUDA BLAS torch runs the linear layers with: "
                            "cublas (torch's default) or cublaslt (cuBLASLt's heuristic picks "
                            "its own kernels, e.g. another split of K at a few rows). Needs a "
                            "CUDA device for cublaslt.", choices=BLAS_LIBRARIES)
    allow_emulated_partitions: bool = doc(
        False, "multiplex / disagg on a GPU whose green contexts cannot be made: run with "
        "nominal partitions on ordinary streams (no real SM split; for debugging only) "
        "instead of stopping at start-up.")
    cuda_graph_max_batch: int = doc(256, "Largest decode batch captured as a CUDA graph.")
    # 512: multiplexing's ShareGPT-like mixed steps (256-384 prompt tokens beside ~140
    # decodes) then replay from graphs instead of running eagerly, where a fresh server's
    # first slow eager steps could lock them out (docs/results.md); costs 0.15 GiB of
    # graphs and ~2 s of capture on the H200.
    piecewise_graph_max_tokens: int = doc(
        512, "Largest whole-GPU step with prompt tokens (chunked prefill, mixed steps) run as "
        "CUDA graphs between its attentions (larger ones are GPU-bound eagerly); 0: none.")
    tensor_parallel_size: int = doc(1, "Split the model across this many GPUs (one worker "
                                    "process per extra rank; on the CPU, processes talking "
                                    "over gloo). Attention heads must divide by it.")


@dataclass(frozen=True)
class TransferConfig:
    kv_transfer_port: int | None = doc(None, "P/D across instances: TCP port of this "
                                       "instance's KV receiver (0: any free port). Unset: "
                                       "the instance neither sends nor receives KV.")
    kv_transfer_host: str = doc("127.0.0.1", "Address the KV receiver binds and announces "
                                "to the other instances.")
    kv_transport: str = doc("auto", "How KV goes to other instances: auto (CUDA IPC between "
                            "GPUs of one host, else NCCL point-to-point between GPU "
                            "instances, else TCP), tcp, ipc, or p2p (torch.distributed: NCCL "
                            "on GPUs, gloo on CPUs). An explicit choice this instance cannot "
                            "run stops start-up; one a peer cannot take fails its transfers "
                            "with the reason.", choices=("auto", "tcp", "ipc", "p2p"))
    kv_transfer_timeout: float = doc(60.0, "Seconds a decode instance waits for a request's "
                                     "KV before failing it.")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        graph_steps = self.scheduler.mux_graph_step_tokens or 0
        most = 0 if self.device.enforce_eager else self.device.piecewise_graph_max_tokens
        if graph_steps > most:
            raise ValueError(f"--mux-graph-step-tokens {graph_steps}: the prefill-step graphs "
                             f"hold at most {most} tokens (--piecewise-graph-max-tokens, "
                             "--enforce-eager); larger steps run eagerly")

    @classmethod
    def from_flat(cls, **kwargs: Any) -> EngineConfig:
        """Builds the layered config from flat keys (``dtype=..., block_size=...``)."""
        parts = {}
        for part in dataclasses.fields(cls):
            part_cls = part.default_factory
            names = {f.name for f in dataclasses.fields(part_cls)}
            parts[part.name] = part_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        return cls(**parts)

    def flat(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in dataclasses.fields(self):
            out.update(dataclasses.asdict(getattr(self, part.name)))
        return out


def add_cli_args(parser: argparse.ArgumentParser, config_cls: type, skip: tuple = ()) -> None:
    """Adds one ``--flag`` per field of ``config_cls``, help text from the field docs."""
    for f in dataclasses.fields(config_cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
            continue
        many = "tuple" in str(f.type)  # tuple[str, ...]: the flag takes one or more values
        parser.add_argument(flag, type=_cli_type(f), default=f.default,
                            nargs="+" if many else None, choices=f.metadata.get("choices"),
                            help=f"{help_text} (default: {f.default})")


def _cli_type(f: dataclasses.Field):
    text = str(f.type)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = set()
    for part in dataclasses.fields(EngineConfig):
        names |= {f.name for f in dataclasses.fields(part.default_factory)}
    return EngineConfig.from_flat(**{k: v for k, v in vars(args).items() if k in names})


ENGINE_CONFIG_PARTS = (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, TransferConfig)
