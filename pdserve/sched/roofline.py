"""A roofline latency model calibrated on CodeLlama-34B measurements on one H200.

GEMMs and attention are separate kernels, so each gets its own roofline
(max of bytes over bandwidth and FLOPs over rate) and their times add.

It answers the same questions as the fitted ``LatencyPredictor`` from first principles
(bytes over bandwidth, FLOPs over rate, contention when co-running), so it serves as
a prior before any profile exists, as the simulator's cost model, and as the known
ground truth that tests generate synthetic profiles from.

Calibration (CodeLlama-34B-shaped GEMMs, one H200):
- bandwidth reached with s SMs: ``peak_bw * (1 - exp(-s / bw_sms_scale))``: 16 SMs read
  the 66 GB of weights in 36 ms, 32 in 24 ms, 64 in 17.5 ms, 132 in 16.3 ms;
- FLOP rate: ``peak_flops * (s / total) ** flops_exponent``: ~700 TFLOP/s on 132 SMs,
  ~580 on 116, ~430 on 68, times ``M / (M + gemm_half_tokens)`` for GEMMs of M tokens
  (short GEMMs fill few tiles);
- co-running: decode slows by ``1.2 + 0.003 * decode_sms`` (x1.22 on 16 SMs, x1.39 on
  64), prefill by ``1 + 0.0085 * other_sms`` (x1.14 beside 16 decode SMs, x1.54 beside 64).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelCost:
    """What one forward pass of a model costs, independent of the GPU."""

    num_layers: int
    weight_bytes: float
    flops_per_token: float  # GEMM FLOPs per token through all layers (2 x parameters)
    kv_bytes_per_token: float  # K and V of one token, all layers
    attn_flops_per_pair: float  # QK^T and PV for one (query, key) pair, all layers

    @classmethod
    def llama(cls, num_layers: int, hidden: int, kv_dim: int, ffn: int, vocab: int = 32000,
              dtype_bytes: int = 2) -> ModelCost:
        per_layer = hidden * (hidden + 2 * kv_dim) + hidden * hidden + 3 * hidden * ffn
        params = num_layers * per_layer + 2 * vocab * hidden
        return cls(num_layers=num_layers, weight_bytes=params * dtype_bytes,
                   flops_per_token=2.0 * params,
                   kv_bytes_per_token=2.0 * num_layers * kv_dim * dtype_bytes,
                   attn_flops_per_pair=4.0 * num_layers * hidden)

    @classmethod
    def codellama_34b(cls) -> ModelCost:
        return cls.llama(num_layers=48, hidden=8192, kv_dim=1024, ffn=22016)


@dataclass(frozen=True)
class GpuCost:
    total_sms: int = 132
    peak_bw: float = 4.1e12  # bytes/s
    bw_sms_scale: float = 27.6
    peak_flops: float = 7.4e14
    flops_exponent: float = 0.72
    gemm_half_tokens: float = 128.0  # GEMMs this short reach half the FLOP rate (tiling)
    step_overhead_ms: float = 0.4  # per launch (decode step or prefill piece)
    per_seq_ms: float = 0.01  # per request in a batch (metadata, sampling)
    decode_contention: tuple[float, float] = (1.2, 0.003)
    prefill_contention: float = 0.0085

    def bandwidth(self, sms: int) -> float:
        return self.peak_bw * (1.0 - math.exp(-sms / self.bw_sms_scale))

    def flop_rate(self, sms: int, tokens: float | None = None) -> float:
        rate = self.peak_flops * (sms / self.total_sms) ** self.flops_exponent
        if tokens is None:
            return rate
        return rate * tokens / (tokens + self.gemm_half_tokens)

    def contention(self, phase: str, sms: int) -> float:
        if sms >= self.total_sms:
            return 1.0
        if phase == "decode":
            base, slope = self.decode_contention
            return base + slope * sms
        return 1.0 + self.prefill_contention * (self.total_sms - sms)


class RooflinePredictor:
    """Latency in ms by the roofline: max(bytes / bandwidth, FLOPs / rate) plus overheads."""

    def __init__(self, model: ModelCost | None = None, gpu: GpuCost | None = None):
        self.model = model or ModelCost.codellama_34b()
        self.gpu = gpu or GpuCost()
        self.num_layers = self.model.num_layers
        self.total_sms = self.gpu.total_sms

    def predict(self, phase: str, num_tokens: int, context_tokens: int, batch_size: int,
                sms: int, co_running: bool = False, num_layers: int | None = None) -> float:
        m, batch = self.model, max(batch_size, 1)
        share = (num_layers or m.num_layers) / m.num_layers
        if phase == "decode":
            pairs = context_tokens
        else:
            pairs = num_tokens * (context_tokens + num_tokens / 2) / batch
        ms = share * (self._gemms(num_tokens, sms) + self._attention(context_tokens, pairs, sms))
        ms += self.gpu.step_overhead_ms + self.gpu.per_seq_ms * batch
        return ms * (self.gpu.contention(phase, sms) if co_running else 1.0)

    def predict_mixed(self, prefill_tokens: int, prefill_context: int, prefill_batch: int,
                      decode_batch: int, decode_context: int, sms: int | None = None) -> float:
        """One whole-GPU step where decode tokens ride along in prefill's GEMMs."""
        sms = sms or self.gpu.total_sms
        batch = max(prefill_batch, 1)
        pairs = prefill_tokens * (prefill_context + prefill_tokens / 2) / batch
        ms = (self._gemms(prefill_tokens + decode_batch, sms)
              + self._attention(prefill_context, pairs, sms)
              + self._attention(decode_context, decode_context, sms))
        return ms + self.gpu.step_overhead_ms + self.gpu.per_seq_ms * (batch + decode_batch)

    def _gemms(self, tokens: int, sms: int) -> float:
        """All layers' GEMMs: weights read once, or compute-bound past the ridge point."""
        m, gpu = self.model, self.gpu
        return 1e3 * max(m.weight_bytes / gpu.bandwidth(sms),
                         tokens * m.flops_per_token / gpu.flop_rate(sms, max(tokens, 1)))

    def _attention(self, kv_tokens: int, pairs: float, sms: int) -> float:
        """Attention kernels run apart from the GEMMs: their own roofline, added."""
        m, gpu = self.model, self.gpu
        return 1e3 * max(kv_tokens * m.kv_bytes_per_token / gpu.bandwidth(sms),
                         pairs * m.attn_flops_per_pair / gpu.flop_rate(sms))


def synthetic_profile(truth: RooflinePredictor, sms_options: list[int], noise: float = 0.03,
                      seed: int = 0) -> list[dict]:
    """Profile rows as an engine profiler would record them, timed by ``truth`` with
    log-normal noise: decode and prefill, alone and co-running, on each SM count."""
    rng = random.Random(seed)
    rows: list[dict] = []

    def add(phase: str, tokens: int, context: int, batch: int, sms: int, co: bool,
            layers: int | None = None) -> None:
        ms = truth.predict(phase, tokens, context, batch, sms, co, layers)
        rows.append(dict(phase=phase, num_tokens=tokens, context_tokens=context,
                         batch_size=batch, sms=sms, co_running=co, num_layers=layers,
                         latency_ms=ms * math.exp(rng.gauss(0.0, noise))))

    full = truth.num_layers
    for sms in sms_options:
        for co in (False, True) if sms < truth.total_sms else (False,):
            for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
                for ctx in (512, 2048, 8192, 16384):
                    add("decode", batch, batch * ctx, batch, sms, co)
            for tokens in (64, 128, 256, 512, 1024, 2048, 4096, 8192):
                for prefix in (0, 4096, 16384):
                    for layers in (1, 4, 12, full):
                        batch = rng.choice((1, 2, 4))
                        add("prefill", tokens, prefix * batch, batch, sms, co, layers)
    return rows
