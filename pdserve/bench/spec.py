"""What one benchmark run sends: a workload and its arrivals, as one reproducible record.

A spec is written on the command line as ``NAME[:key=value,...]`` (``sharegpt:num=200,rate=4``)
so one command can run several workloads against each server it starts; keys not given
come from the ordinary flags (``--num-prompts``, ``--request-rate`` ...).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pdserve.bench import workloads
from pdserve.bench.arrivals import gamma_arrivals
from pdserve.bench.sharegpt import TextTokenizer, sharegpt_workload
from pdserve.bench.workloads import BenchError, BenchRequest

DATASETS = ("random", "sharegpt", "loogle", "mooncake")
ALIASES = {"num": "num_prompts", "rate": "request_rate", "concurrency": "max_concurrency",
           "trace": "path"}


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str = "random"
    num_prompts: int = 100
    input_len: int = 1024
    """random: mean prompt length."""
    output_len: int = 128
    """random: mean output length."""
    range_ratio: float = 0.0
    """random: lengths uniform in [len * (1 - r), len * (1 + r)]."""
    output_range_ratio: float | None = None
    """random: the same for output lengths alone (None: range_ratio; 0: fixed length)."""
    path: str | None = None
    """mooncake: trace file; sharegpt: a ShareGPT JSON file (without it: synthetic lengths)."""
    max_context: int | None = None
    """Clip prompts so prompt + output fits this many tokens."""
    vocab_size: int = 256
    """Prompt token ids are drawn below this (ids < 256 exist in every byte-level or BPE vocab)."""
    seed: int = 0
    request_rate: float = math.inf
    """Requests/s; inf sends all at once. mooncake: the trace is rescaled to this mean rate."""
    burstiness: float = 1.0
    """Gamma shape of inter-arrival gaps: 1 Poisson, < 1 burstier."""
    max_concurrency: int | None = None
    trace_time_scale: float = 1.0
    """mooncake without a rate: multiply trace times (0.5 replays twice as fast)."""
    trace_start_s: float = 0.0
    trace_duration_s: float | None = None
    trace_spread: int = 0
    """mooncake: 1 takes num_prompts rows evenly spread over the window, 0 the first ones."""
    block_size: int = 512
    """mooncake: tokens per hash id."""
    label: str | None = None
    ttft_slo_ms: float | None = None
    """Overrides --ttft-slo-ms for this workload (long prompts need a looser TTFT SLO)."""
    itl_slo_ms: float | None = None
    """Overrides --itl-slo-ms for this workload."""

    @property
    def name(self) -> str:
        return self.label or self.dataset

    def build(self, tokenizer: TextTokenizer | None = None) -> list[BenchRequest]:
        """The requests; ``tokenizer`` (the served model's) is needed for a ShareGPT file."""
        if self.dataset == "sharegpt" and self.path:
            return sharegpt_workload(self.path, self.num_prompts, tokenizer, self.seed,
                                     self.max_context)
        if self.path and self.dataset != "mooncake":
            raise BenchError(f"{self.dataset} reads no file (path {self.path!r}): only "
                             "sharegpt and mooncake do")
        if self.dataset == "random":
            return workloads.random_workload(self.num_prompts, self.input_len, self.output_len,
                                             self.range_ratio, self.seed, self.vocab_size,
                                             self.max_context, self.output_range_ratio)
        if self.dataset in workloads.SHAPES:
            return workloads.shaped_workload(self.dataset, self.num_prompts, self.seed,
                                             self.vocab_size, self.max_context)
        if self.dataset == "mooncake":
            return self._build_trace()
        raise BenchError(f"unknown dataset {self.dataset!r}; one of {', '.join(DATASETS)}")

    def _build_trace(self) -> list[BenchRequest]:
        if not self.path:
            raise BenchError("mooncake needs a trace path (--dataset-path or path=...)")
        return workloads.mooncake_workload(
            self.path, self.seed, self.vocab_size, self.block_size, self.trace_start_s,
            self.trace_duration_s, self.num_prompts, time_scale=self.trace_time_scale,
            max_context=self.max_context, spread=bool(self.trace_spread))

    def offsets(self, requests: list[BenchRequest], rate: float | None = None) -> list[float]:
        """Send offsets at ``rate`` (default: the spec's). A trace keeps its own shape:
        at a finite rate it is stretched to that mean rate, else replayed as recorded."""
        rate = self.request_rate if rate is None else rate
        if self.dataset == "mooncake":
            times = [float(r.arrival_s or 0.0) for r in requests]
            return workloads.rescale_arrivals(times, None if math.isinf(rate) else rate)
        return gamma_arrivals(len(requests), rate, self.burstiness, self.seed)

    def describe(self) -> dict:
        out = dataclasses.asdict(self)
        out["request_rate"] = _json_float(self.request_rate)
        out["arrivals"] = self._arrival_kind()
        out["lengths"] = self._length_source()
        return out

    def _length_source(self) -> str:
        if self.dataset in workloads.SHAPES and not (self.dataset == "sharegpt" and self.path):
            return f"synthetic ({self.dataset}-like lognormal)"
        return "file" if self.path else "random"

    def _arrival_kind(self) -> str:
        if self.dataset == "mooncake":
            return "trace" if math.isinf(self.request_rate) else "trace-rescaled"
        if math.isinf(self.request_rate):
            return "all-at-once"
        return "poisson" if self.burstiness == 1.0 else "gamma"


def _json_float(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def parse_spec(text: str, defaults: WorkloadSpec) -> WorkloadSpec:
    """``NAME[:key=value,...]`` over ``defaults``; keys are field names or their aliases."""
    name, _, rest = text.partition(":")
    changes: dict = {"dataset": name.strip()} if name.strip() else {}
    types = {f.name: f.type for f in dataclasses.fields(WorkloadSpec)}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if not sep or key not in types:
            raise BenchError(f"bad workload option {item!r} in {text!r}")
        changes[key] = _convert(value.strip(), str(types[key]))
    return dataclasses.replace(defaults, **changes)


def _convert(value: str, type_text: str):
    if value.lower() == "none" and "None" in type_text:
        return None
    if type_text.startswith("float"):
        return float(value)
    if type_text.startswith("int"):
        return int(value)
    return value
