"""Goodput of every schedule on three workloads, one recorded probe at a time (issue 10).

A *probe* is one open-loop run of one workload at one rate against one configuration; it
writes its per-request records to its own JSON under ``benchmarks/results/goodput_h200/``
(``<workload>__<config>__r<rate>.json``). Device time comes in short calls, so evidence
accumulates probe by probe across calls:

- ``run``: the probes asked for (``--probe W:C:R``) or, with ``--search W:C1,C2``, the next
  rates of each configuration's goodput search, read from the probes already recorded (a
  doubling-then-bisecting search on the workload's rate ladder). A probe whose JSON exists is
  skipped; one server start per configuration per call (per probe for multiplex, which
  learns online: ``learns_online``); no probe starts that cannot finish
  within ``--budget-s`` (arrivals + the workload's drain allowance), and one that overruns
  anyway is cut at the limit and writes nothing.
- ``summarise``: attainment at every probed rate under every SLO, goodput (or its bracket),
  the probes missing next, Figure 3 (goodput against the ITL SLO) and the README table.
- ``import-legacy``: converts the committed records that match a probe's definition.

Workloads (prompts are random token ids; CodeLlama-34B, dummy weights, one H200):

| name | arrivals, requests | lengths | TTFT SLO |
|---|---|---|---|
| loogle | 90 s, 10-30 | prompts uniform 12,000-20,000, 64 out (ignore_eos) | 15 s |
| sharegpt | 25 s, 50-400 | ShareGPT-like lognormal (~340 in / ~250 out) | 2 s |
| mooncake | 90 s, 20-80 | Mooncake conversation trace, its first 10 minutes | 5 s |

TPOT <= 60 ms everywhere (Figure 3: 40, 60, 80, 100 ms). Requests per probe are the rate
times the arrival span, clipped: low rates get fewer requests from the same arrival process
(Poisson, seed 0; the trace's own times rescaled), high rates are capped so a probe stays
about two and a half minutes (three probes and a server start fit one 9-minute device call).
The span is long enough for a queue to build at the knee: LooGLE-like prompts take ~2 s of
prefill each, so at 0.3 req/s 27 requests bring ~55 s of prefill work in 90 s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import hashlib
import json
import math
import re
import shlex
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# Runnable from a plain checkout: the package sits one folder up.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.client import HttpBackend  # noqa: E402
from pdserve.bench.compare import DEFAULT_SERVER_CMD, ManagedServer  # noqa: E402
from pdserve.bench.evidence import (  # noqa: E402
    ATTAINMENT_HEADER,
    Search,
    SearchSpace,
    attainment_table,
    figure3_points,
    goodput_cell,
    goodput_table,
    load_records,
    missing_probes,
    off_definition,
    runs_per_probe,
    searches,
)
from pdserve.bench.metrics import sample_attainment  # noqa: E402
from pdserve.bench.report import (  # noqa: E402
    check_gpu,
    load_json,
    portable_command,
    result_header,
    write_json,
)
from pdserve.bench.runner import RunContext, SloOptions, run_at_rate, warm_up  # noqa: E402
from pdserve.bench.spec import WorkloadSpec, parse_spec  # noqa: E402
from pdserve.bench.timeline import load_engine_timeline, timeline_beside  # noqa: E402
from pdserve.bench.workloads import BenchError, salted, workload_stats  # noqa: E402
from pdserve.config import ran_explicitly  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "goodput_h200"
TRACE = ROOT / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"
# Profiled at 20d5278 with the long-context grid (prompt pieces over cached prefixes up to
# 16K, 128-token pieces, decode on 16-64 SMs); the probes from 20d5278 on ran with it, those
# at e1f3fe3 with 3edb18c_predictor.json, from efbfdd5 to 3fa127d with d698fcb_predictor.json
# (each record names its file).
PREDICTOR = ROOT / "benchmarks" / "results" / "loogle_h200" / "20d5278_predictor.json"
TPOT_SLO_MS = 60.0
FIGURE3_ITL_MS = (40.0, 60.0, 80.0, 100.0)
TARGET = 0.9
STOP_S = 15.0
"""Allowance for stopping a server (SIGTERM, engine exit) at the end of a call."""


@dataclass(frozen=True)
class ProbeWorkload:
    name: str
    spec: str
    """A ``pdserve bench`` workload spec without num and rate; ``{trace}`` is the trace path."""
    ttft_slo_ms: float
    span_s: float
    min_requests: int
    max_requests: int
    drain_s: float
    """Allowed after the last arrival for the last outputs (and the warm-up)."""
    ladder: tuple[float, ...]
    start_rate: float

    def num_requests(self, rate: float) -> int:
        return max(self.min_requests, min(self.max_requests, round(rate * self.span_s)))

    def build_spec(self, rate: float, trace: Path) -> WorkloadSpec:
        text = self.spec.format(trace=trace)
        spec = parse_spec(f"{text},num={self.num_requests(rate)},rate={rate}", WorkloadSpec())
        return dataclasses.replace(spec, label=self.name, ttft_slo_ms=self.ttft_slo_ms,
                                   itl_slo_ms=TPOT_SLO_MS)


WORKLOADS = {w.name: w for w in (
    ProbeWorkload("loogle", "random:input_len=16000,range_ratio=0.25,output_len=64,"
                  "output_range_ratio=0,vocab_size=32000,seed=0", 15000.0, 90.0, 10, 30,
                  45.0, (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6),
                  0.3),
    ProbeWorkload("sharegpt", "sharegpt:vocab_size=32000,seed=0", 2000.0, 25.0, 50, 400,
                  30.0, (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0),
                  6.0),
    # Prompts past the served context (24,576) are clipped to it: 16% of the window's rows.
    ProbeWorkload("mooncake", "mooncake:trace={trace},trace_duration_s=600,trace_spread=1,"
                  "max_context=24576,vocab_size=32000,seed=0", 5000.0, 90.0, 20, 80, 60.0,
                  (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0), 0.5),
)}

MUX_ARGS = "--schedule multiplex --max-num-batched-tokens 24576 --mux-predictor {predictor}"
CONFIGS = {f"chunk{c}": f"--schedule chunked --chunk-size {c}" for c in (256, 512, 1024, 2048)}
CONFIGS["prefill-first"] = "--schedule prefill-first --max-num-batched-tokens 24576"
# Decode on 56 of the 132 SMs, as the engine's disagg baseline has run on the H200.
CONFIGS["disagg"] = "--schedule disagg --disagg-decode-sms 56 --max-num-batched-tokens 24576"
# Multiplex configurations name their graph-step and floor flags: both became the engine's
# defaults after the H200 probes at 38d366f (graph steps where the prefill-step graphs are
# captured, a 256-token floor), so "multiplex-itl60" keeps meaning what its records ran.
NO_GRAPH_STEPS, GRAPH_STEPS = " --mux-graph-step-tokens 0", " --mux-graph-step-tokens 256"
NO_FLOOR, FLOOR_ARGS = " --mux-mixed-floor-tokens 0", " --mux-mixed-floor-tokens 256"
CONFIGS.update({f"multiplex-itl{itl:g}":
                f"{MUX_ARGS} --itl-slo-ms {itl:g}{NO_GRAPH_STEPS}{NO_FLOOR}"
                for itl in FIGURE3_ITL_MS})
# Mixed steps only, and mixed steps that fit the 256-token prefill-step graphs weighed as
# an option of their own: A/B against multiplex-itl60 and chunk256.
CONFIGS["multiplex-temporal-itl60"] = CONFIGS["multiplex-itl60"] + " --mux-sharing temporal"
CONFIGS["multiplex-graph-itl60"] = f"{MUX_ARGS} --itl-slo-ms 60{GRAPH_STEPS}{NO_FLOOR}"
# The same with each option's prefill correction converging on its pieces' measured over
# predicted time instead of compounding it (the Mooncake A/B against multiplex-graph-itl60).
CONVERGING = " --mux-prefill-correction converging"
CONFIGS["multiplex-graph-converging-itl60"] = CONFIGS["multiplex-graph-itl60"] + CONVERGING
# Mixed steps that keep a 256-token chunk (on the graphs) where the per-step budget would cut
# it smaller, over long prefixes (docs/results.md, "Where the Mooncake probe's prefill
# went"): with every option (the engine's default multiplex now), with the prefill
# corrections converging too, and with mixed steps only (chunked prefill's steps with the
# ITL budget kept where the chunk allows).
CONFIGS["multiplex-graph-floor-itl60"] = f"{MUX_ARGS} --itl-slo-ms 60{GRAPH_STEPS}{FLOOR_ARGS}"
CONFIGS["multiplex-graph-floor-converging-itl60"] = (
    CONFIGS["multiplex-graph-floor-itl60"] + CONVERGING)
CONFIGS["multiplex-temporal-graph-floor-itl60"] = (
    CONFIGS["multiplex-graph-floor-itl60"] + " --mux-sharing temporal")
# Every correction the median of its last 32 ratios: a short run of slow steps moves none
# (on 8ccd9ac three slow eager steps raised the eager correction 1.03 -> 1.11 and locked
# eager mixed steps out for the rest of the run; docs/cluster.md).
CONFIGS["multiplex-graph-floor-window32-itl60"] = (
    CONFIGS["multiplex-graph-floor-itl60"] + " --mux-correction-window 32")
# The guards against a correction locking a path out: a step or piece over 3x its prediction
# teaches nothing (a stall), a correction not observed halves its deviation from the
# profile over 100 observations of the others (at 6f2d50e, ShareGPT-like 18 req/s, slow
# first steps priced eager mixed steps out for the whole run on three fresh servers); alone,
# and with the converging prefill rule, whose 18 req/s probe the lock-out confounded.
GUARDS = " --mux-stall-ratio 3 --mux-correction-half-life 100"
CONFIGS["multiplex-graph-floor-guarded-itl60"] = CONFIGS["multiplex-graph-floor-itl60"] + GUARDS
CONFIGS["multiplex-graph-floor-guarded-converging-itl60"] = (
    CONFIGS["multiplex-graph-floor-converging-itl60"] + GUARDS)
# With the guards, each co-running option's prefill correction learned from what its
# batches delivered (first piece to last) instead of from its pieces: on the committed
# timelines time-slice pieces ran at 0.99-1.04 of their prediction while their batches
# delivered 0.82-0.95 of the committed rate.
CONFIGS["multiplex-graph-floor-guarded-delivery-itl60"] = (
    CONFIGS["multiplex-graph-floor-guarded-itl60"] + " --mux-prefill-correction delivery")
# SLO-aware admission order (--prefill-order slo) against the same config in arrival order.
# The deadline is the workload's own TTFT SLO (``{ttft_slo_ms}``: one server per workload).
# On multiplex --ttft-slo-ms also caps a new batch by the oldest prompt's slack, so the
# -ttft config (that cap, arrival order) separates the order's effect from the cap's.
SLO_ORDER_ARGS = " --ttft-slo-ms {ttft_slo_ms} --prefill-order slo"
CONFIGS["chunk256-slo"] = CONFIGS["chunk256"] + SLO_ORDER_ARGS
CONFIGS["multiplex-graph-floor-ttft-itl60"] = (CONFIGS["multiplex-graph-floor-itl60"]
                                               + " --ttft-slo-ms {ttft_slo_ms}")
CONFIGS["multiplex-graph-floor-slo-itl60"] = (CONFIGS["multiplex-graph-floor-itl60"]
                                              + SLO_ORDER_ARGS)
# Mixed steps and time slices past the per-step budget by the TPOT slack the decode batch
# banked, up to 2x / 3x the ITL target (chunked 1024's mixed steps on the Mooncake trace ran
# ~150 ms, 2.5x, at TPOT p50 29 ms): against multiplex-graph-floor-itl60 and chunk1024.
for cap in (2, 3):
    CONFIGS[f"multiplex-graph-floor-bank{cap}-itl60"] = (
        CONFIGS["multiplex-graph-floor-itl60"] + f" --mux-tpot-bank-cap {cap}")
# Mixed steps and time slices to the whole ITL target while a waiting prompt is predicted
# to miss its TTFT (the workload's own SLO) at the 0.9 margin's rate: on the ShareGPT-like
# workload at 16 req/s the 0.9 margin's 52 ms steps fell behind the arrivals (TTFT P50
# 1.8 s) where chunked 512 kept up. Against multiplex-graph-floor-ttft-itl60 (the same
# --ttft-slo-ms, the pressure off) and with the bank.
# 1.0 and 0.95 of the target (TPOT is a mean: steps at the target leave it no room).
PRESSED_ARGS = " --ttft-slo-ms {ttft_slo_ms} --mux-ttft-pressed-margin 1"
CONFIGS["multiplex-graph-floor-pressed-itl60"] = (CONFIGS["multiplex-graph-floor-itl60"]
                                                  + PRESSED_ARGS)
CONFIGS["multiplex-graph-floor-pressed95-itl60"] = (
    CONFIGS["multiplex-graph-floor-itl60"] + PRESSED_ARGS.replace("margin 1", "margin 0.95"))
CONFIGS["multiplex-graph-floor-bank3-pressed-itl60"] = (
    CONFIGS["multiplex-graph-floor-bank3-itl60"] + PRESSED_ARGS)
# The bank (the ShareGPT-like lever: a TPOT SLO is a mean, and chunked 512 leads there by
# steps past the per-step budget) with the lock-out guards and the delivery rule.
CONFIGS["multiplex-graph-floor-bank3-guarded-delivery-itl60"] = (
    CONFIGS["multiplex-graph-floor-bank3-itl60"] + GUARDS + " --mux-prefill-correction delivery")
# The floor taken whole as an eager step where cutting it to the graphs' room beside the
# decode batch would prefill slower (docs/results.md, "Why 1.2 is a cliff").
CONFIGS["multiplex-graph-floor-off-graphs-itl60"] = (
    CONFIGS["multiplex-graph-floor-itl60"] + " --mux-floor-off-graphs")
# Prefill-step graphs up to 512 tokens (prompt and decode), weighed by the planner up to
# there too: ShareGPT-like steps (256-384 prompt tokens beside ~140 decodes) replay from
# graphs instead of launching ~12 kernels a layer from Python. At c78302c / 2c58bf1 the
# eager mixed steps of fresh servers ran 1.1-1.6x their prediction in bursts in their first
# seconds (graph steps within 1-2%, no kernel compiled, with CUDA_MODULE_LOADING=EAGER as
# well), lifting the eager correction to 1.14-1.28 for the rest of the run; chunked prefill
# with the same graphs, so the baseline gets them too.
# At 3fa127d they held on every workload (ShareGPT-like 14, Mooncake 0.275, LooGLE-like
# >= 0.6; runs of one probe within a point of each other) and became the engine's default;
# the configurations above keep the 256-token graphs their records ran.
FLAGS_AS_GIVEN = dict(CONFIGS)  # the imported runs' flags (below): they predate the pin
CONFIGS = {name: f"{args} --piecewise-graph-max-tokens 256" for name, args in CONFIGS.items()}
GRAPH512 = " --piecewise-graph-max-tokens 512"
CONFIGS["multiplex-graph512-floor-itl60"] = (
    f"{MUX_ARGS} --itl-slo-ms 60{GRAPH512} --mux-graph-step-tokens 512{FLOOR_ARGS}")
CONFIGS["chunk512-graph512"] = FLAGS_AS_GIVEN["chunk512"] + GRAPH512
# With them multiplexing's ShareGPT-like misses at 16 req/s were all TTFT (TPOT p99 56 ms,
# under the SLO): the TPOT bank spends that slack on prefill.
CONFIGS["multiplex-graph512-floor-bank3-itl60"] = (
    CONFIGS["multiplex-graph512-floor-itl60"] + " --mux-tpot-bank-cap 3")
# The bank made 16 worse (65%: more time slices, whose compounding prefill correction walked
# to 1.73 while their pieces ran at 1.03-1.05 of the profile). Next at 16: the TTFT pressure
# (97% / 96% at 22537b9 on 256 graphs), the converging correction (compared before only where
# runs locked out), and mixed steps only (chunked prefill's steps with the ITL budget kept).
CONFIGS["multiplex-graph512-floor-pressed-itl60"] = (
    CONFIGS["multiplex-graph512-floor-itl60"] + PRESSED_ARGS)
CONFIGS["multiplex-graph512-floor-converging-itl60"] = (
    CONFIGS["multiplex-graph512-floor-itl60"] + CONVERGING)
CONFIGS["multiplex-temporal-graph512-floor-itl60"] = (
    CONFIGS["multiplex-graph512-floor-itl60"] + " --mux-sharing temporal")
# Without SM splits: the split that opened the run's first co-running batch delivered 0.67
# of the rate it was chosen by, the time slices after it 0.85 (docs/results.md).
CONFIGS["multiplex-nosplit-graph512-floor-itl60"] = (
    CONFIGS["multiplex-graph512-floor-itl60"] + " --mux-sharing temporal,time_slice")
# Or every option kept, SM splits and time slices weighed from the start at the ~0.8 of their
# rate that their batches delivered (0.67-0.95 over the three workloads), learning from each
# batch's delivery after that.
CONFIGS["multiplex-graph512-floor-corun125-delivery-itl60"] = (
    CONFIGS["multiplex-graph512-floor-itl60"]
    + " --mux-co-running-correction 1.25 --mux-prefill-correction delivery")
# The delivery rule alone (no start discount): on the LooGLE-like workload at 3edb18c the
# compounding rule weighed time slices at twice what their batches delivered.
CONFIGS["multiplex-graph512-floor-delivery-itl60"] = (
    CONFIGS["multiplex-graph512-floor-itl60"] + " --mux-prefill-correction delivery")
# Time slices became opt-in and the converging prefill rule the default after e1f3fe3 (on
# the H200 time slices' batches delivered less prefill than mixed steps in every run where
# both ran; the compounding rule walked their factor to its 0.5 bound): every multiplex
# configuration above runs what its records ran (named at the end of the table).
# The engine's defaults since then, named in full.
CONFIGS["multiplex-graph512-floor-converging-noslice-itl60"] = (
    f"{MUX_ARGS} --itl-slo-ms 60{GRAPH512} --mux-graph-step-tokens 512{FLOOR_ARGS}"
    " --mux-sharing temporal,spatial --mux-prefill-correction converging")
# With them (20d5278) multiplexing's ShareGPT-like misses at 17 req/s were all TTFT (154 of
# 400; TPOT p99 55 ms, 9% of the target unused) and chunked 512's all TPOT: the defaults
# with mixed steps planned to the whole ITL target while a waiting prompt is predicted to
# miss its TTFT.
CONFIGS["multiplex-graph512-floor-converging-noslice-pressed-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-itl60"] + PRESSED_ARGS)
# The pressure did not help on one run (17: 54%; its SM-split batches ran 9.9 of the first
# 24 s against 3.6 without). Mixed steps beside ~150 decodes are where the per-step budget
# binds: at 0.9 of the target they carried 256 prompt tokens (4.8K tokens/s) where a step at
# the whole target would carry ~300, and TPOT p99 stayed at 55 ms. Next: the defaults
# planned to 0.97 of the target throughout, and with the TPOT bank up to 2x the target (the
# bank ran only beside time slices and the compounding rule before, at 5ef4698: 65%).
CONFIGS["multiplex-graph512-floor-converging-noslice-margin97-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-itl60"] + " --mux-itl-margin 0.97")
CONFIGS["multiplex-graph512-floor-converging-noslice-bank2-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-itl60"] + " --mux-tpot-bank-cap 2")
# Planned to 0.97 of the target (a11edb9 profile) it was no better at 17 req/s (58%): its
# mixed steps beside ~150 decodes still carried the floor's 256 tokens in 54 ms (4.7K tokens/s
# against ~5.5K arriving) where chunked 512's steps carry 512 and its TPOT p99 stays at 63 ms.
# The defaults with a 512-token floor: steps of up to 1.25x the target, as the floor allows
# (the SLO is a request's mean, and its decode-only steps run at ~20 ms).
CONFIGS["multiplex-graph512-floor512-converging-noslice-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-itl60"].replace(
        "--mux-mixed-floor-tokens 256", "--mux-mixed-floor-tokens 512"))
# The 512-token floor held to the ITL target itself: on ShareGPT-like requests its steps
# were cut to the graphs' room (~358 prompt tokens beside ~140 decodes, 64 ms measured), on
# LooGLE-like ones the 1.25x cap let 384-token steps over 12-20K prefixes run 70.6 ms (TPOT
# misses 7 of 30); under 1.0x the floor should keep the first and give back the second.
CONFIGS["multiplex-graph512-floor512cap1-converging-noslice-itl60"] = (
    CONFIGS["multiplex-graph512-floor512-converging-noslice-itl60"]
    + " --mux-mixed-floor-cap 1.0")
# The bank did not move ShareGPT-like 17 at 2x (52%, f81aa7e): it is the tightest
# request's, and in a burst a request that just joined has banked nothing, so every step
# stayed at the budget while the others had banked hundreds of ms. Spent at the 5% quantile
# of the batch's banks instead (one request in twenty may be left with less), up to 2x.
CONFIGS["multiplex-graph512-floor-converging-noslice-bank2q5-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-bank2-itl60"]
    + " --mux-tpot-bank-quantile 0.05")
# At fdd80df the default's ShareGPT-like 16 req/s run that failed (61%, against 95% at
# 20d5278) spent 8.6 s in back-to-back spatial batches at ~4.3K prompt tokens/s, where mixed
# steps ran ~5.4K before and after: each batch that ended beside a decode step on the split
# was followed by another there, weighed among spatial options alone. Here the next batch is
# weighed against every option first, and the lanes drain for a switch when another wins.
CONFIGS["multiplex-graph512-floor-converging-noslice-reweigh-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-itl60"]
    + " --mux-reweigh-spatial-batches")
# The whole planner chose those batches by 5.1-6.2K predicted and got ~4.3K: with the
# reweighing, each option's correction learned from what its batches delivered (the
# delivery rule). In the step model's replays of the 61% run and of the 95% one, 16 of 16
# draws passed, against 14 with the reweighing alone (a prediction; the model is 8-23
# points pessimistic on LooGLE-like and Mooncake replays, where it rated this worst).
CONFIGS["multiplex-graph512-floor-delivery-noslice-reweigh-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-reweigh-itl60"].replace(
        "--mux-prefill-correction converging", "--mux-prefill-correction delivery"))
# The reweighing cut the spatial batches (61-148 decisions against 397) and took ShareGPT-like
# 16 req/s from 59% to 68-69% on fresh servers in one call (0162a0c): still every miss a TTFT
# miss, TPOT P99 57-59 ms. Beside ~150 decodes its mixed steps carried the floor's 256 prompt
# tokens in 54 ms (0.9 of the target); chunked 512's carried the graphs' ~350 in 62.7 ms
# (1.05x) and its TPOT P99 stayed at 63 ms. With the reweighing, mixed steps planned past
# the target, to 1.05x / 1.1x, only while a waiting prompt is predicted to miss its TTFT.
for pressed in (105, 110):
    CONFIGS[f"multiplex-graph512-floor-converging-noslice-reweigh-pressed{pressed}-itl60"] = (
        CONFIGS["multiplex-graph512-floor-converging-noslice-reweigh-itl60"]
        + PRESSED_ARGS.replace("margin 1", f"margin {pressed / 100:g}"))
# The step model (mux_step_replay.py over the 0162a0c reweigh record, its own engine timing,
# graph steps by decode batch) put pressed105 at 90-97% at 17 req/s (TPOT P99 61 ms: the
# steps past the target stretch the tail's mean) and, with the TPOT bank spent beside it
# at the 5% quantile up to 1.2x the target, 90-98% (median 97%, TPOT P99 60 ms); at 16
# req/s 90-100%, LooGLE-like 0.6 90-97% (as run 77-83%), Mooncake as run (88%).
CONFIGS["multiplex-graph512-floor-converging-noslice-reweigh-bank120q5-pressed105-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-reweigh-pressed105-itl60"]
    + " --mux-tpot-bank-cap 1.2 --mux-tpot-bank-quantile 0.05")
# The same with mixed steps only (no SM splits): 100% at 16, 89-98% at 17, LooGLE-like 0.6
# 87-97%, Mooncake 96% at 0.275 and 100% at 0.3 where the splits held the model at 88%.
CONFIGS["multiplex-graph512-floor-converging-temporal-bank120q5-pressed105-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-noslice-reweigh-bank120q5-pressed105-itl60"]
    .replace("--mux-sharing temporal,spatial", "--mux-sharing temporal")
    .replace(" --mux-reweigh-spatial-batches", ""))
# At 6b7fcf7 both fell short at 17 (73% / 77% against chunked 512's 86%): under the burst
# their mixed steps carried 292 prompt tokens in 56.6 ms where chunked 512's carried 363 in
# 62.4 ms. Replayed from T's run with its own timing (as run 78-83%, measured 77%), steps
# planned to the whole target with the bank up to 1.5x read 84-88%, the best of the variants
# tried (docs/results.md, "The bank beside the pressure on the GPU").
CONFIGS["multiplex-graph512-floor-converging-temporal-bank150q5-pressed105-margin100-itl60"] = (
    CONFIGS["multiplex-graph512-floor-converging-temporal-bank120q5-pressed105-itl60"]
    .replace("--mux-tpot-bank-cap 1.2", "--mux-tpot-bank-cap 1.5") + " --mux-itl-margin 1")
# B's SM splits weighed from the start at what the Mooncake probe's splits learned (its
# 0.2875 req/s run at 5d0f7fe: prefill corrections 1.16-1.39 per split, and a split not
# run yet starting at 1.0 chose a 24K-token prompt's first batch at 7.1K tokens/s over mixed
# steps' 6.0K; it delivered ~4.6K, TTFT 5.2 s against chunked 512's 4.2 s).
_B = "multiplex-graph512-floor-converging-noslice-reweigh-bank120q5-pressed105-itl60"
CONFIGS[_B.replace("-itl60", "-corun130-itl60")] = CONFIGS[_B] + " --mux-co-running-correction 1.3"
# With the bank to 2x as well: over prefixes past 10K tokens chunked 512 kept 509-token
# chunks at 94 ms a step (5.3K tokens/s) where B's mixed steps held ~62 ms with 256 (4.4K),
# the 1.2x cap binding beside 2-4 decodes whose TPOT (a mean) stayed at 41 ms P99.
CONFIGS[_B.replace("bank120q5-pressed105-itl60", "bank200q5-pressed105-corun130-itl60")] = (
    CONFIGS[_B].replace("--mux-tpot-bank-cap 1.2", "--mux-tpot-bank-cap 2.0")
    + " --mux-co-running-correction 1.3")
# B2 with each mixed step's tokens, the decodes' included, aligned to 64 as chunked prefill's
# are: in B2's LooGLE-like probes (f67d252) every mixed step was 1-3 tokens past a graph bucket
# (256 + 2 decodes run as 272) and per prompt token over the same prefixes cost 4-10% more
# than chunked 256's steps of exactly 256 (docs/results.md, "Mixed steps held to 60 ms").
_B2 = _B.replace("bank120q5-pressed105-itl60", "bank200q5-pressed105-corun130-itl60")
CONFIGS[_B2.replace("-itl60", "-aligned-itl60")] = CONFIGS[_B2] + " --mux-align-step-tokens"
# The same aligned to the graphs' 16-token buckets only: no padding, finer fill.
CONFIGS[_B2.replace("-itl60", "-aligned16-itl60")] = (
    CONFIGS[_B2] + " --mux-align-step-tokens --mux-token-align 16")
# The same aligned to 128, the GEMMs' row tile: over 8-12K prefixes steps of exactly 256
# tokens carried 5.7K prompt tokens/s, 257-352 (the defaults' 3-tile steps, splits on or
# off) 5.1-5.4K and 384 5.8K (committed timelines of 0c8789f, 9f669fe and f67d252): a
# step's GEMMs cost by 128-row tiles, so a step past a multiple of 128 pays for the next.
CONFIGS[_B2.replace("-itl60", "-aligned128-itl60")] = (
    CONFIGS[_B2] + " --mux-align-step-tokens --mux-token-align 128")
# The same planned to 0.95 of the target, not 0.9: served at 0.5 req/s (6a43faf) the
# 128-aligned steps sat at 0.89 of the target at the median where the defaults' sat at
# 0.95 (a step rounded down to a whole tile leaves the rest of the budget); replayed on
# the 0.65 req/s probe's requests it attained 80-87% against 77-83% at 0.9
# (benchmarks/results/mux_step_replay/loogle_b2_aligned128_margin95_cad3faa.json).
CONFIGS[_B2.replace("-itl60", "-aligned128-margin95-itl60")] = (
    CONFIGS[_B2] + " --mux-align-step-tokens --mux-token-align 128 --mux-itl-margin 0.95")
# Both in SLO-aware admission order (B2 names --ttft-slo-ms already): on the LooGLE-like
# 0.65 req/s probe's arrivals and prompts, one server prefilling whole prompts at B2's
# effective 5,840 tokens/s meets 22 of 30 TTFTs in arrival order (B2 measured 22) and 28 in
# Moore-Hodgson order (`slo_order_replay.py --prefill-rate 5840`, an offline queue model).
for _name in (_B2, _B2.replace("-itl60", "-aligned128-margin95-itl60")):
    CONFIGS[_name.replace("-itl60", "-slo-itl60")] = CONFIGS[_name] + " --prefill-order slo"
# Every multiplex configuration keeps the meaning its records ran with when the defaults
# change (time slices and the compounding rule after e1f3fe3, B2's flags after 8a6ad63):
# what it does not name, named as it ran.
CONFIGS = {name: ran_explicitly(args) if name.startswith("multiplex") else args
           for name, args in CONFIGS.items()}
# The engine's default multiplex first (B2's flags, with --ttft-slo-ms), then the ones its
# earlier records ran.
TABLE_CONFIGS = ("multiplex-graph512-floor-converging-noslice-reweigh-bank200q5-pressed105-"
                 "corun130-itl60", "multiplex-graph512-floor-converging-noslice-itl60",
                 "multiplex-graph512-floor-itl60", "multiplex-graph-floor-itl60",
                 "multiplex-itl60", "chunk256", "chunk512", "chunk512-graph512", "chunk1024",
                 "chunk2048", "prefill-first", "disagg")
SERVER_ARGS = "--load-format dummy --max-model-len 24576"


def itl_target(config: str) -> float | None:
    """The ITL SLO a multiplex configuration (``multiplex[-<variant>]-itl<N>``) serves to
    (None: not a multiplex one)."""
    match = re.fullmatch(r"multiplex(?:-[a-z][a-z0-9-]*?)?-itl(\d+(?:\.\d+)?)", config)
    return float(match.group(1)) if match else None


def probe_path(results: Path, workload: str, config: str, rate: float) -> Path:
    return results / f"{workload}__{config}__r{rate:g}.json"


def repeat_path(folders: list[Path], written: Path, workload: str, config: str,
                rate: float) -> Path:
    """The first ``<probe>__rep<k>.json`` (k >= 2) that no folder holds yet, in ``written``."""
    stem = probe_path(written, workload, config, rate).stem
    k = 2
    while any((folder / f"{stem}__rep{k}.json").exists() for folder in (*folders, written)):
        k += 1
    return written / f"{stem}__rep{k}.json"


# --- which probes: explicit, or the next of each search ---------------------------------------

@dataclass(frozen=True)
class Target:
    workload: str
    config: str
    rate: float | None = None
    """None: the next rate of this pair's goodput search."""


def parse_probe(text: str) -> Target:
    parts = text.split(":")
    if len(parts) != 3:
        raise SystemExit(f"bad --probe {text!r}: expected WORKLOAD:CONFIG:RATE")
    return _checked(Target(parts[0], parts[1], float(parts[2])))


def parse_search(text: str) -> list[Target]:
    workload, _, configs = text.partition(":")
    if not configs:
        raise SystemExit(f"bad --search {text!r}: expected WORKLOAD:CONFIG[,CONFIG...]")
    return [_checked(Target(workload, c.strip())) for c in configs.split(",") if c.strip()]


def _checked(target: Target) -> Target:
    if target.workload not in WORKLOADS:
        raise SystemExit(f"unknown workload {target.workload!r}; known: {', '.join(WORKLOADS)}")
    if target.config not in CONFIGS:
        raise SystemExit(f"unknown config {target.config!r}; known: {', '.join(CONFIGS)}")
    if target.rate is not None and not (target.rate > 0 and math.isfinite(target.rate)):
        raise SystemExit(f"bad rate {target.rate} for {target.workload}:{target.config}")
    return target


def search_slos(config: str) -> list[float]:
    """TPOT SLOs whose goodput this configuration's probes decide: a multiplex server serves
    one ITL target; a chunked one is judged against each Figure 3 target from one run."""
    if itl_target(config) is not None:
        return [itl_target(config)]
    return list(FIGURE3_ITL_MS) if config.startswith("chunk") else [TPOT_SLO_MS]


def search_spaces() -> dict[str, SearchSpace]:
    return {w.name: SearchSpace(w.ttft_slo_ms, w.ladder, w.start_rate, TARGET)
            for w in WORKLOADS.values()}


def next_search_rate(folders: list[Path], workload: str, config: str) -> float | None:
    """The next rate of this pair's searches (TPOT 60 first, then the Figure 3 targets), from
    the records in ``folders``."""
    wanted = [(workload, config, slo)
              for slo in sorted(search_slos(config), key=lambda s: s != TPOT_SLO_MS)]
    records = [r for folder in folders for r in load_records(folder)]
    found = searches(records, wanted, search_spaces())
    return next((s.next_rate for s in found if s.next_rate is not None), None)


# --- running ----------------------------------------------------------------------------------

@dataclass
class Budget:
    deadline: float
    """time.monotonic() after which no work may still run."""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return seconds + STOP_S <= self.left()


@dataclass
class RunOptions:
    results: Path
    trace: Path
    predictor: Path
    model: str
    server_args: str
    port: int
    startup_s: float
    """Expected server start-up (healthy), counted before the first probe of a config."""
    max_probes: int
    """Per configuration per call, for --search targets."""
    budget: Budget
    server_cmd: str = DEFAULT_SERVER_CMD
    out: Path | None = None
    """Where new records and server logs go (a device call's output folder); None: results.
    Recorded probes and search states are read from both."""
    failed: list[str] = dataclasses.field(default_factory=list)
    """Configurations whose server did not come up (the call's exit status is then 1)."""
    repeat: bool = False
    """Explicit probes run again when recorded, each repeat in a file of its own."""

    def written(self) -> Path:
        return self.out or self.results

    def folders(self) -> list[Path]:
        return [self.results] if self.out is None else [self.results, self.out]


def probe_seconds(workload: ProbeWorkload, rate: float, trace: Path) -> float:
    """Last arrival + the drain allowance: what a probe needs before it may start."""
    spec = workload.build_spec(rate, trace)
    offsets = spec.offsets(spec.build(), rate)
    return (offsets[-1] if offsets else 0.0) + workload.drain_s


def learns_online(config: str) -> bool:
    """Whether ``config``'s server learns while it serves (multiplexing corrects its
    predictions online), so a probe run after another on the same server starts from what
    the earlier one taught it. On the H200 a multiplex probe that followed another on its
    server inherited prefill corrections walked to their bounds (ShareGPT-like at 18 req/s
    after 20: a split weighed at twice its rate); every such probe gets a fresh server."""
    return "--schedule multiplex" in CONFIGS[config]


def per_workload(config: str) -> bool:
    """Whether ``config``'s server takes the workload's TTFT SLO (one server per workload)."""
    return "{ttft_slo_ms}" in CONFIGS[config]


def config_args(config: str, predictor: Path, workload: str | None) -> str:
    """``config``'s server flags for ``workload`` (needed where ``per_workload``)."""
    slo = WORKLOADS[workload].ttft_slo_ms if workload is not None else None
    if per_workload(config) and slo is None:
        raise ValueError(f"{config} takes a workload's TTFT SLO; none given")
    return CONFIGS[config].format(predictor=shlex.quote(str(predictor)), ttft_slo_ms=f"{slo:g}"
                                  if slo is not None else "")


def by_config(targets: list[Target]) -> dict[tuple[str, str | None], list[Target]]:
    """Targets grouped per configuration (and per workload where the server takes the
    workload's TTFT SLO), in first-mention order (one server start each)."""
    groups: dict[tuple[str, str | None], list[Target]] = {}
    for target in targets:
        workload = target.workload if per_workload(target.config) else None
        groups.setdefault((target.config, workload), []).append(target)
    return groups


class ConfigRun:
    """One configuration's server for this call: started when the first probe that fits the
    budget needs it, stopped at the end."""

    def __init__(self, config: str, opts: RunOptions, workload: str | None = None) -> None:
        self.config = config
        self.opts = opts
        self.args = config_args(config, opts.predictor, workload)
        self.server: ManagedServer | None = None
        self.backend: HttpBackend | None = None
        self.warmed: set[str] = set()
        self.done = 0
        self.served = 0  # probes this server ran before the current one

    def command(self) -> list[str]:
        args = self.args
        template = self.opts.server_cmd.format(model=shlex.quote(self.opts.model),
                                               port=self.opts.port)
        return shlex.split(template) + shlex.split(self.opts.server_args) + shlex.split(args)

    async def start(self, first_record: Path) -> None:
        """A server, its log named after the record of the probe it starts for (a server
        that learns online starts again for each probe, a repeat's included: a name of
        the probe alone kept only the last repeat's log)."""
        log = self.opts.written() / "logs" / f"{first_record.stem}.log"
        self.server = ManagedServer(self.command(), self.opts.port, log)
        print(f"[goodput] {self.config}: {shlex.join(self.server.command)}", flush=True)
        self.server.start()
        await self.server.wait_healthy(max(1.0, self.opts.budget.left() - STOP_S))
        self.backend = HttpBackend(self.server.url)
        await self.backend.start()

    async def stop(self) -> None:
        if self.backend is not None:
            await self.backend.close()
        if self.server is not None:
            self.server.stop()
        self.server, self.backend, self.served = None, None, 0
        self.warmed.clear()

    async def probe_done(self) -> None:
        """After a probe: a server that learns online is stopped, so the next probe starts
        from the profile alone (``learns_online``); others serve on."""
        self.served += 1
        if learns_online(self.config):
            await self.stop()

    def needs(self, workload: ProbeWorkload, rate: float) -> float:
        start = 0.0 if self.server is not None else self.opts.startup_s
        return start + probe_seconds(workload, rate, self.opts.trace)


def attainment_line(result: dict, ttft_slo_ms: float, config: str) -> str:
    """The probe's attainment at the workload's SLOs and, for a configuration with an ITL
    target of its own (multiplex-itl80, ...), also at that target: the figure its Figure 3
    cell is searched by."""
    line = f"attainment {result['slo_attainment']:.3f}"
    target = itl_target(config)
    if target is None or target == TPOT_SLO_MS:
        return line
    own = sample_attainment(result.get("samples") or [], ttft_slo_ms, target)
    if own is None:
        return line
    return f"{line} (TPOT {TPOT_SLO_MS:g} ms), {own:.3f} at TPOT {target:g} ms"


def defined_probe(path: Path) -> bool:
    """Whether a recorded probe sent the request count its workload defines (imported runs
    from before the definition may not; those are run again when asked for)."""
    record = json.loads(path.read_text())
    probe = record["probe"]
    return len(record["samples"]) == expected_requests(probe["workload"], probe["rate"])


def next_probe(target: Target, run: ConfigRun) -> float | None:
    """The rate to probe for ``target`` now, or None when it has nothing (left) to run."""
    folders = run.opts.folders()
    if target.rate is not None:
        paths = [probe_path(f, target.workload, target.config, target.rate) for f in folders]
        recorded = any(p.exists() and defined_probe(p) for p in paths)
        return None if recorded and not run.opts.repeat else target.rate
    if run.done >= run.opts.max_probes:
        return None
    return next_search_rate(folders, target.workload, target.config)


class ServerFailed(RuntimeError):
    """A configuration's server did not come up: its probes are skipped, the call goes on."""


async def run_config(config: str, targets: list[Target], opts: RunOptions,
                     workload: str | None = None) -> bool:
    """Every target of one configuration (of one workload where its server takes the
    workload's SLO); False once the budget stopped the call."""
    run = ConfigRun(config, opts, workload)
    try:
        for target in targets:
            if not await _run_target(target, run):
                return False
        return True
    except ServerFailed as exc:
        print(f"[goodput] {config}: {exc}; its probes are not run", flush=True)
        opts.failed.append(config)
        return True
    finally:
        await run.stop()


async def _run_target(target: Target, run: ConfigRun) -> bool:
    """The target's probe, or its search's next probes; False once one was cut at the
    budget limit. A probe too long for what is left is skipped (a shorter one may fit)."""
    workload = WORKLOADS[target.workload]
    while (rate := next_probe(target, run)) is not None:
        needed = run.needs(workload, rate)
        if not run.opts.budget.allows(needed):
            print(f"[goodput] budget: {target.workload}:{target.config}:{rate:g} needs "
                  f"~{needed:.0f} s, {run.opts.budget.left() - STOP_S:.0f} s left; not "
                  "started", flush=True)
            return True
        if not await _probe(run, workload, rate):
            return False
        if target.rate is not None:
            return True
    return True


async def _probe(run: ConfigRun, workload: ProbeWorkload, rate: float) -> bool:
    """One probe, recorded; False when the budget cut it (nothing is written then)."""
    path = record_path(run.opts, workload.name, run.config, rate)
    if run.server is None:
        try:
            await run.start(path)
        except (BenchError, RuntimeError, TimeoutError, OSError) as exc:
            raise ServerFailed(f"server not up: {exc}") from None
    spec = workload.build_spec(rate, run.opts.trace)
    # Fresh tokens per rate: the server's prefix cache holds the previous probes' prompts.
    requests = salted(spec.build(), 1 + round(rate * 1000), spec.vocab_size)
    label = f"{workload.name}:{run.config}:{rate:g}"
    try:
        result = await asyncio.wait_for(_measure(run, workload, spec, requests, rate),
                                        timeout=max(1.0, run.opts.budget.left() - STOP_S))
    except TimeoutError:
        print(f"[goodput] {label} cut at the budget limit; nothing written", flush=True)
        return False
    write_json(probe_record(run, spec, requests, rate, result), path)
    write_timeline(result.get("engine_timeline") or [], path)
    run.done += 1
    await run.probe_done()
    print(f"[goodput] {label}: {attainment_line(result, workload.ttft_slo_ms, run.config)} "
          f"-> {path}", flush=True)
    return True


def record_path(opts: RunOptions, workload: str, config: str, rate: float) -> Path:
    """Where a new probe's record goes: its own name, or a repeat's when that is taken."""
    path = probe_path(opts.written(), workload, config, rate)
    taken = any(probe_path(f, workload, config, rate).exists() for f in opts.folders())
    if opts.repeat and taken:
        return repeat_path(opts.folders(), opts.written(), workload, config, rate)
    return path


async def _measure(run: ConfigRun, workload: ProbeWorkload, spec: WorkloadSpec,
                   requests: list, rate: float) -> dict:
    if workload.name not in run.warmed:  # once per server: kernels compile on first use
        await warm_up(run.backend, requests[:2])
        run.warmed.add(workload.name)
    ctx = RunContext(progress=False, keep_samples=True)
    slo = SloOptions(workload.ttft_slo_ms, TPOT_SLO_MS)
    result = await run_at_rate(run.backend, spec, requests, rate, slo, ctx)
    result["engine_after"] = await run.backend.fetch_engine_info()
    return result


def write_timeline(entries: list[dict], record_path: Path) -> None:
    """A probe's engine timeline beside its record: a multiplex probe's planner decisions,
    predicted and measured (for ``benchmarks/mux_whatif.py --timeline``), the other
    schedules' steps with their shapes and times (``sim_goodput_probes.py --steps``)."""
    with gzip.open(timeline_beside(record_path), "wt") as out:
        json.dump(entries, out)


def compact_samples(samples: list[dict]) -> list[dict]:
    """Per-request records without the per-token gaps (the summary keeps their stats)."""
    return [{k: v for k, v in s.items() if k != "itl_ms"} for s in samples]


def predictor_info(path: Path) -> dict:
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"path": repo_relative(path), "sha256": digest}


def repo_relative(path: str | Path | None) -> str | None:
    """A file inside the repository as a path from its root (the trace's default is
    absolute, and the device's checkout path is that machine's own); others as given."""
    if not path:
        return None if path is None else str(path)
    path = Path(path)
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def probe_record(run: ConfigRun, spec: WorkloadSpec, requests: list, rate: float,
                 result: dict) -> dict:
    engine = run.backend.engine_info or {}
    modes = Counter(e.get("mode") for e in result.get("engine_timeline") or [])
    summary = {k: v for k, v in result.items()
               if k not in ("samples", "timeline", "engine_timeline", "engine_after")}
    after = result.get("engine_after") or {}
    record = result_header({"name": run.config,
                            "server_command": portable_command(run.server.command),
                            "server_args": run.args, "engine": engine})
    return {**record, "probe": {"workload": spec.label, "config": run.config, "rate": rate,
                                "requests": len(requests)},
            "workload": {**spec.describe(), "path": repo_relative(spec.path),
                         **workload_stats(requests),
                         "definition": dataclasses.asdict(WORKLOADS[spec.label])},
            "predictor": predictor_info(run.opts.predictor)
            if itl_target(run.config) is not None else None,
            "server": {"probes_before": run.served,
                       "fresh_per_probe": learns_online(run.config)},
            "partitions": engine.get("partitions"), "engine_modes": dict(modes),
            "calibration_after": after.get("calibration"),
            # Kernels compiled while serving (each stalled a step; None: an older engine).
            "compiled_while_serving": after.get("kernels_compiled_while_serving"),
            # cudaMalloc calls and allocation retries while serving (None: an older engine).
            "allocator_while_serving": after.get("allocator_while_serving"),
            # As the engine reports it (None: an engine older than the flag, arrival order).
            "prefill_order": {k: after.get(k, engine.get(k)) for k in (
                "prefill_order", "prefill_order_rate_tokens_per_s", "prefill_order_reorders")},
            "summary": summary, "samples": compact_samples(result["samples"])}


async def run_targets(targets: list[Target], opts: RunOptions) -> None:
    for (config, workload), group in by_config(targets).items():
        if not await run_config(config, group, opts, workload):
            break


# --- summary ----------------------------------------------------------------------------------

def probed_variants(records: list[dict]) -> list[str]:
    """Configurations outside the README table's that have probes (A/B variants such as
    multiplex-graph-itl60 at ITL 60), in CONFIGS order."""
    probed = {r["probe"]["config"] for r in records}
    return [c for c in CONFIGS if c in probed and c not in TABLE_CONFIGS
            and itl_target(c) == TPOT_SLO_MS]


def wanted_searches(figure3_workloads: list[str], variants: list[str] = ()
                    ) -> list[tuple[str, str, float]]:
    """The README table's searches (TPOT 60) and those of the probed ``variants``, then
    Figure 3's (ITL 40..100)."""
    wanted = [(w, c, TPOT_SLO_MS) for w in WORKLOADS for c in (*TABLE_CONFIGS, *variants)]
    for workload in figure3_workloads:
        for itl in FIGURE3_ITL_MS:
            wanted += [(workload, f"chunk{c}", itl) for c in (256, 512, 1024, 2048)]
            wanted.append((workload, f"multiplex-itl{itl:g}", itl))
    return list(dict.fromkeys(wanted))


def figure3_family(config: str) -> str | None:
    return "multiplex" if itl_target(config) is not None else \
        config if config.startswith("chunk") else None


def figure3(found: list[Search], workload: str, out_dir: Path) -> str:
    """Figure 3 of ``workload``: the plot (when matplotlib is there) and its table."""
    mine = [s for s in found if s.workload == workload and s.tpot_slo_ms in FIGURE3_ITL_MS
            and (itl_target(s.config) in (None, s.tpot_slo_ms))]
    series = figure3_points(mine, figure3_family)
    plotted = _plot_figure3(series, mine, out_dir / f"figure3_{workload}.png", workload)
    ladder = WORKLOADS[workload].ladder
    lines = [f"### Figure 3, {workload}: goodput (req/s) against the ITL SLO", "",
             "| configuration | " + " | ".join(f"ITL {itl:g} ms" for itl in FIGURE3_ITL_MS)
             + " |", "|---" * (len(FIGURE3_ITL_MS) + 1) + "|"]
    cells = figure3_cells(mine)
    for family in ["multiplex"] + [f"chunk{c}" for c in (256, 512, 1024, 2048)]:
        row = [_figure3_cell(cells[(family, itl)], ladder) if (family, itl) in cells else "-"
               for itl in FIGURE3_ITL_MS]
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    if plotted:
        lines += ["", f"Plot: `{plotted.name}`."]
    return "\n".join(lines)


def figure3_cells(searches_: list[Search]) -> dict[tuple[str | None, float], Search]:
    """(family, ITL SLO) -> the search that cell shows: of several multiplex configurations
    at one target, the probed one with the highest goodput (an unprobed variant must not
    hide a measured one)."""
    cells: dict[tuple[str | None, float], Search] = {}
    rank = lambda s: (bool(s.curve), s.bracket.low)
    for search in searches_:
        key = (figure3_family(search.config), search.tpot_slo_ms)
        if key not in cells or rank(search) > rank(cells[key]):
            cells[key] = search
    return cells


def _figure3_cell(search: Search, ladder: tuple[float, ...]) -> str:
    cell = goodput_cell(search, ladder)
    return f"{cell} ({search.config})" if search.curve and itl_target(search.config) else cell


def _plot_figure3(series: dict, found: list[Search], path: Path, workload: str) -> Path | None:
    try:
        from pdserve.bench.plots import plot_goodput_vs_slo
    except ImportError:
        print("figure 3: no plot without matplotlib (pip install 'pdserve[bench]')")
        return None
    settled = {(figure3_family(s.config), s.tpot_slo_ms): s.finished for s in found}
    points = {name: [(slo, b.low, b.high, settled[(name, slo)]) for slo, b in pts]
              for name, pts in series.items()}
    return plot_goodput_vs_slo(points, path, f"{workload}: goodput against the ITL SLO")


CONFIGS_PER_CALL = 2
"""Searches per device call: two server starts and two or three probes fill ~8.5 minutes."""


def run_commands(probes: list[tuple[str, str, float]]) -> list[str]:
    """Device calls that resume the unfinished searches, a few configurations per call."""
    pending: dict[str, list[str]] = {}
    for workload, config, _ in probes:
        if config not in pending.setdefault(workload, []):
            pending[workload].append(config)
    commands = []
    for workload, configs in pending.items():
        for i in range(0, len(configs), CONFIGS_PER_CALL):
            group = ",".join(configs[i:i + CONFIGS_PER_CALL])
            commands.append(f"python benchmarks/goodput_h200.py run --search {workload}:{group} "
                            "--max-probes 2 --budget-s 510 --out $OUT/goodput")
    return commands


def expected_requests(workload: str, rate: float) -> int:
    return WORKLOADS[workload].num_requests(rate)


def run_label(record: dict) -> str:
    """A run's revision, and the environment variables it ran with (an A/B's arms)."""
    env = record.get("environment_variables") or {}
    return ", ".join([(record.get("git_revision") or "unknown")[:7],
                      *(f"{k}={v}" for k, v in sorted(env.items()))])


def repeated_probes(records: list[dict]) -> list[str]:
    """Markdown lines: every run of each probe that ran more than once (oldest first), its
    attainment at the workload's SLOs and its revision; the newest decides the search."""
    lines = []
    for (workload, config, rate), group in sorted(runs_per_probe(records).items()):
        if len(group) < 2 or workload not in WORKLOADS:
            continue
        ttft_ms = WORKLOADS[workload].ttft_slo_ms
        cells = [f"{100 * (sample_attainment(r['samples'], ttft_ms, TPOT_SLO_MS) or 0.0):.0f}% "
                 f"({run_label(r)})" for r in group]
        lines.append(f"| {workload} | {config} | {rate:g} | {', '.join(cells)} |")
    if not lines:
        return []
    return ["", "## Repeated probes (every run, oldest first; the newest decides the search)",
            "", "| workload | config | rate (req/s) | attainment (revision) |",
            "|---|---|---|---|", *lines]


CALL_GAP_S = 20 * 60  # records of one command further apart than this came from two calls


def _server_key(record: dict) -> tuple:
    """Records with one key ran on one server if they came from one call: the same run
    command and revision, the same configuration (and workload where it takes its SLO)."""
    probe = record["probe"]
    workload = probe["workload"] if per_workload(probe["config"]) else None
    return (tuple(record.get("command") or ()), record.get("git_revision"), probe["config"],
            workload)


def probes_before_on_server(records: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Each probe of a configuration that learns online with the probes its server ran
    before it: as recorded (``server``), or, for records from before that field, the
    earlier records of the same call on the same server (``_server_key``; a gap over
    ``CALL_GAP_S`` starts another call)."""
    runs: dict[tuple, list[dict]] = {}
    out = []
    for record in sorted(records, key=lambda r: r.get("created", "")):
        config = record["probe"]["config"]
        if config not in CONFIGS or not learns_online(config):
            continue
        if "goodput_h200.py" not in " ".join(record.get("command") or ()):
            continue  # imported from another tool: how its server ran is not recorded
        earlier = runs.setdefault(_server_key(record), [])
        if earlier and _seconds_between(earlier[-1], record) > CALL_GAP_S:
            earlier.clear()
        served = (record.get("server") or {}).get("probes_before")
        if served is None:
            served = len(earlier)
        out.append((record, earlier[len(earlier) - served:] if served else []))
        earlier.append(record)
    return out


def _seconds_between(first: dict, second: dict) -> float:
    """Seconds from one record's creation to another's (0 where either has no timestamp)."""
    try:
        parse = lambda r: datetime.fromisoformat(r["created"])
        return (parse(second) - parse(first)).total_seconds()
    except (KeyError, ValueError):
        return 0.0


def warm_server_probes(records: list[dict]) -> list[str]:
    """Markdown lines: the probes that ran on a server which had served earlier probes
    (and had learned from them), with what ran before."""
    lines = []
    for record, before in probes_before_on_server(records):
        if not before:
            continue
        probe = record["probe"]
        ttft_ms = WORKLOADS[probe["workload"]].ttft_slo_ms
        share = sample_attainment(record["samples"], ttft_ms, TPOT_SLO_MS) or 0.0
        after = ", ".join(f"{r['probe']['workload']} {r['probe']['rate']:g}" for r in before)
        lines.append(f"| {probe['workload']} | {probe['config']} | {probe['rate']:g} | "
                     f"{100 * share:.0f}% | {(record.get('git_revision') or '')[:7]} | {after} |")
    if not lines:
        return []
    return ["", "## Probes on a server that had served earlier probes", "",
            "Multiplexing corrects its predictions while it serves; these probes started from "
            "what the earlier ones on their server taught it, not from the profile alone. "
            "Probes recorded with a `server` field ran on a server of their own.", "",
            "| workload | config | rate (req/s) | attainment | revision | after, on its server |",
            "|---|---|---|---|---|---|", *lines]


SHARING_MODES = ("temporal", "spatial", "time_slice")  # a step that also prefills


def budget_use(timeline: list[dict], itl_ms: float) -> dict | None:
    """How much of the ITL target a multiplex probe's steps used while they prefilled:
    each sharing step's measured cycle over the target (quantiles), and how many steps
    decoded alone (nothing to prefill, or nothing that fitted); and its spatial decisions,
    with the seconds from the first to the last (on ShareGPT-like loads the runs that
    spent seconds in back-to-back spatial batches are the ones that failed)."""
    shares = sorted(e["measured_cycle_ms"] / itl_ms for e in timeline
                    if e["mode"] in SHARING_MODES and e["measured_cycle_ms"] > 0)
    if not shares:
        return None
    at = lambda q: round(shares[min(len(shares) - 1, int(q * len(shares)))], 2)
    spatial = [e["time"] for e in timeline if e["mode"] == "spatial"]
    return {"sharing_steps": len(shares), "p10": at(0.1), "p50": at(0.5), "p90": at(0.9),
            "decode_only_steps": sum(e["mode"] == "decode_only" for e in timeline),
            "spatial_decisions": len(spatial),
            "spatial_span_s": round(max(spatial) - min(spatial), 1) if spatial else 0.0}


def budget_use_lines(results: Path) -> list[str]:
    """Markdown lines: ``budget_use`` of every multiplex probe whose timeline is kept."""
    lines = []
    record_of = lambda t: t.with_name(t.name.removesuffix("_timeline.json.gz") + ".json")
    for timeline in sorted(results.glob("*__r*_timeline.json.gz"), key=record_of):
        path = record_of(timeline)
        record = json.loads(path.read_text()) if path.exists() else {}
        config = (record.get("probe") or {}).get("config", "")
        itl = itl_target(config) if config in CONFIGS else None
        if itl is None:
            continue
        use = budget_use(load_engine_timeline(timeline), itl)
        if use is not None:
            probe, repeat = record["probe"], path.stem.partition("__rep")[2]
            rate = f"{probe['rate']:g}" + (f" (run {repeat})" if repeat else "")
            attained = sample_attainment(record["samples"],
                                         WORKLOADS[probe["workload"]].ttft_slo_ms, TPOT_SLO_MS)
            lines.append(f"| {probe['workload']} | {config} | {rate} | "
                         f"{100 * (attained or 0.0):.0f}% | "
                         f"{use['sharing_steps']} | {use['p10']} / {use['p50']} / "
                         f"{use['p90']} | {use['decode_only_steps']} | "
                         f"{use['spatial_decisions']} over {use['spatial_span_s']:g} s |")
    if not lines:
        return []
    return ["", "## The ITL budget used (multiplex probes)", "",
            "Each step that also prefilled: its measured cycle (between two decode tokens) "
            "over the configuration's ITL target, from the probe's timeline (the engine keeps "
            "its most recent decisions); and its spatial decisions, from the first to the "
            "last.", "",
            "| workload | config | rate (req/s) | attainment | sharing steps | cycle / target "
            "p10 / p50 / p90 | decode-only steps | spatial decisions |",
            "|---|---|---|---|---|---|---|---|", *lines]


def summary_markdown(found: list[Search], figure3_workloads: list[str], out_dir: Path,
                     variants: list[str] = (), repeats: list[str] = ()) -> str:
    rows = [*TABLE_CONFIGS, *variants]
    table = [s for s in found if s.tpot_slo_ms == TPOT_SLO_MS and s.config in rows]
    missing = missing_probes(found, expected_requests)
    parts = ["# Goodput on the H200 (CodeLlama-34B, dummy weights)", "",
             "Goodput = the highest probed rate with >= 90% of requests within TTFT "
             "(loogle 15 s, sharegpt 2 s, mooncake 5 s) and TPOT 60 ms; `between a and b`: "
             "a passed, b failed, the rates between not yet probed.", "",
             goodput_table(table, search_spaces(), list(WORKLOADS), rows,
                           expected_requests), "",
             "## Attainment of every search", "", ATTAINMENT_HEADER]
    parts += [attainment_table(s, expected_requests) for s in found]
    parts += repeats
    parts += ["", *(figure3(found, w, out_dir) + "\n" for w in figure3_workloads)]
    parts += ["## Missing next (one per unfinished search)", ""]
    parts += [f"- {w}:{c}:{r:g}" for w, c, r in missing] or ["- nothing: every search ended"]
    if missing:
        parts += ["", "Device calls that resume them:", "", "```", *run_commands(missing), "```"]
    return "\n".join(parts) + "\n"


def summarise(results: Path, out_dir: Path, figure3_workloads: list[str]) -> dict:
    records = load_records(results)
    variants = probed_variants(records)
    found = searches(records, wanted_searches(figure3_workloads, variants), search_spaces())
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = summary_markdown(found, figure3_workloads, out_dir, variants,
                                repeated_probes(records) + warm_server_probes(records)
                                + budget_use_lines(results))
    (out_dir / "summary.md").write_text(markdown)
    data = {"searches": [_search_json(s) for s in found],
            "missing": [{"workload": w, "config": c, "rate": r}
                        for w, c, r in missing_probes(found, expected_requests)]}
    write_json(data, out_dir / "summary.json")
    print(markdown)
    return data


def _search_json(search: Search) -> dict:
    return {"workload": search.workload, "config": search.config,
            "tpot_slo_ms": search.tpot_slo_ms, "curve": search.curve,
            "goodput_rps": search.bracket.low, "lowest_failing_rps": search.bracket.high,
            "finished": search.finished, "next_rate": search.next_rate,
            "revisions": search.revisions,
            "off_definition_requests": {f"{rate:g}": n for rate, n in
                                        off_definition(search, expected_requests).items()}}


# --- committed records that match a probe's definition ----------------------------------------

LOOGLE_H200 = ROOT / "benchmarks" / "results" / "loogle_h200"
# LooGLE-like runs of benchmarks/loadgen_loogle.py: uniform 12,000-20,000, 64 out, Poisson,
# seed 0 (Python's random rather than numpy's: the same distributions), but 40 requests
# where a probe of 0.3 or 0.5 req/s sends 27 or 30: the same workload, a longer run.
# The 36d9d59 multiplex runs at ITL 60 are left out: 4f22d08 reran them (newer code).
_MUX_36D9D59 = "--schedule multiplex --max-num-batched-tokens 24576"  # profiled in that run
_MUX_4F22D08 = (f"{_MUX_36D9D59} --itl-slo-ms 60 --mux-decode-sms 16,24,32,48,64 "
                f"--mux-predictor {PREDICTOR.relative_to(ROOT)}")
_MUX_6F90BE1 = (f"{_MUX_36D9D59} --itl-slo-ms 60 --mux-decode-sms 16,24,32,48,64 "
                "--mux-predictor benchmarks/results/loogle_h200/6f90be1_predictor.json")
# Newest first: a probe already imported is never overwritten by an older run.
LEGACY_LOOGLE = {  # file: (config, rate, revision, server flags after SERVER_ARGS)
    "6f90be1_multiplex_rate0.5_records.json": ("multiplex-itl60", 0.5, "6f90be1",
                                               _MUX_6F90BE1),
    "6f90be1_chunk1024_rate0.5_records.json": ("chunk1024", 0.5, "6f90be1",
                                               FLAGS_AS_GIVEN["chunk1024"]),
    "36d9d59_pdserve_chunk512_rate0.3.json": ("chunk512", 0.3, "36d9d59",
                                             FLAGS_AS_GIVEN["chunk512"]),
    "36d9d59_pdserve_chunk512_rate0.5.json": ("chunk512", 0.5, "36d9d59",
                                             FLAGS_AS_GIVEN["chunk512"]),
    "36d9d59_pdserve_chunk1024_rate0.5.json": ("chunk1024", 0.5, "36d9d59",
                                               FLAGS_AS_GIVEN["chunk1024"]),
    "36d9d59_pdserve_prefill_first_rate0.5.json": ("prefill-first", 0.5, "36d9d59",
                                                   FLAGS_AS_GIVEN["prefill-first"]),
    "36d9d59_pdserve_multiplex_itl80_rate0.5.json": ("multiplex-itl80", 0.5, "36d9d59",
                                                     f"{_MUX_36D9D59} --itl-slo-ms 80"),
    "mux_rate0.3_records.json": ("multiplex-itl60", 0.3, "4f22d08", _MUX_4F22D08),
    "mux_rate0.5_records.json": ("multiplex-itl60", 0.5, "4f22d08", _MUX_4F22D08),
}
LOADGEN_COMMAND = ("python benchmarks/loadgen_loogle.py --api openai --url http://127.0.0.1:PORT "
                   "--model codellama-34b --num-requests 40 --rate {rate} --input-min 12000 "
                   "--input-max 20000 --output-len 64 --warmup --seed 0 --out result.json")
# `pdserve bench compare` runs whose ShareGPT-like workload is this one at 6 req/s exactly
# (150 requests, seed 0, vocabulary 32,000, two warm-up requests). Their LooGLE runs are
# not: lognormal 10-16K prompts, 20 requests.
LEGACY_SHAREGPT = {"baseline_h200_part1.json.gz": ("chunk512", "chunk2048", "prefill-first"),
                   "baseline_h200_multiplex.json.gz": ("multiplex",)}


def _loadgen_samples(requests: list[dict]) -> list[dict]:
    out = []
    for r in requests:
        tpot = (r["e2e"] - r["ttft"]) / (r["output_len"] - 1) \
            if r.get("ok") and r.get("output_len", 0) > 1 else None
        out.append({"prompt_len": r["input_len"], "output_len": 64,
                    "output_tokens": r.get("output_len"), "success": bool(r.get("ok")),
                    "error": r.get("error", ""), "send_s": r["sent_at"],
                    "ttft_ms": _ms(r.get("ttft")), "tpot_ms": _ms(tpot),
                    "e2e_ms": _ms(r.get("e2e"))})
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _legacy_record(source: Path, probe: dict, head: dict, server_args: str,
                   samples: list[dict]) -> dict:
    """A probe record of an imported run: ``head`` holds created, git_revision, command and
    device as the source states them."""
    uses_predictor = "--mux-predictor" in server_args
    return {"version": 1, **head, "imported_from": str(source.relative_to(ROOT)),
            "config": {"name": probe["config"], "server_args": server_args},
            "predictor": predictor_info(PREDICTOR) if uses_predictor else None,
            "probe": {**probe, "requests": len(samples)}, "samples": samples}


def _commit_date(revision: str) -> str:
    import subprocess

    done = subprocess.run(["git", "log", "-1", "--format=%cI", revision], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"import-legacy needs the git history ({revision}): {done.stderr}")
    return done.stdout.strip()


def import_call(folder: Path, results: Path, label: str) -> list[Path]:
    """A device call's ``run --out`` folder into ``results``: each record with its timeline,
    renamed to the next free repeat where ``results`` already holds its name (two calls at
    one revision both write ``__rep2``), and its server log as
    ``server_logs_<revision>/<label>_<record>.log``. The call's output folder, a path of
    the device machine, is written ``$OUT/<folder name>`` in the record's command."""
    written = []
    for source in sorted(p for p in folder.glob("*.json") if "__" in p.stem):
        text = source.read_text()
        record = json.loads(text)
        command = record.get("command") or []
        if "--out" in command[:-1]:
            device_out = Path(command[command.index("--out") + 1])
            text = text.replace(f"{device_out.parent}/", "$OUT/")
        probe, target = record["probe"], results / source.name
        if target.exists():
            target = repeat_path([results], results, probe["workload"], probe["config"],
                                 probe["rate"])
        target.write_text(text)
        logs = results / f"server_logs_{record['git_revision'][:7]}"
        copies = {timeline_beside(source): timeline_beside(target),
                  folder / "logs" / f"{source.stem}.log": logs / f"{label}_{target.stem}.log"}
        written.append(target)
        for copied, to in copies.items():
            if copied.exists():
                to.parent.mkdir(exist_ok=True)
                written.append(Path(shutil.copyfile(copied, to)))
    return written


def import_legacy(results: Path) -> list[Path]:
    written = [_import_loadgen(name, entry, results) for name, entry in LEGACY_LOOGLE.items()]
    for name, configs in LEGACY_SHAREGPT.items():
        written += _import_compare(ROOT / "benchmarks" / "results" / name, configs, results)
    return [p for p in written if p is not None]


def _import_loadgen(name: str, entry: tuple, results: Path) -> Path | None:
    config, rate, revision, flags = entry
    source = LOOGLE_H200 / name
    samples = _loadgen_samples(json.loads(source.read_text())["requests"])
    head = {"created": _commit_date(revision), "git_revision": revision,
            "command": LOADGEN_COMMAND.format(rate=rate),
            "device": {"gpus": ["NVIDIA H200"], "source": "loogle_h200/README.md"}}
    probe = {"workload": "loogle", "config": config, "rate": rate}
    record = _legacy_record(source, probe, head, f"{SERVER_ARGS} {flags}", samples)
    return _write_new(record, probe_path(results, "loogle", config, rate))


def _import_compare(source: Path, configs: tuple[str, ...], results: Path) -> list[Path | None]:
    data = load_json(source)
    head = {k: data[k] for k in ("created", "git_revision", "command", "device")}
    written = []
    for run in data["runs"]:
        if run["name"] not in configs or run["workload"]["dataset"] != "sharegpt":
            continue
        config = "multiplex-itl60" if run["name"] == "multiplex" else run["name"]
        probe = {"workload": "sharegpt", "config": config, "rate": 6.0}
        record = _legacy_record(source, probe, head, shlex.join(run["server_args"]),
                                compact_samples(run["samples"]))
        written.append(_write_new(record, probe_path(results, "sharegpt", config, 6.0)))
    return written


def _write_new(record: dict, path: Path) -> Path | None:
    """Never overwrites: a probe measured here beats an imported one."""
    if path.exists():
        return None
    write_json(record, path)
    return path


# --- CLI --------------------------------------------------------------------------------------

def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="Run probes (skipping recorded ones) within a budget.")
    p.add_argument("--probe", action="append", default=[], metavar="WORKLOAD:CONFIG:RATE")
    p.add_argument("--search", action="append", default=[], metavar="WORKLOAD:CONFIG[,...]",
                   help="The next rates of each configuration's goodput search.")
    p.add_argument("--max-probes", type=int, default=3,
                   help="Search probes per configuration in this call.")
    p.add_argument("--budget-s", type=float, required=True,
                   help="Wall-clock limit of this call; no probe starts that cannot end in it.")
    p.add_argument("--startup-s", type=float, default=45.0,
                   help="Server start-up allowance (measured ~25 s on the H200).")
    p.add_argument("--model", default="codellama-34b")
    p.add_argument("--server-args", default=SERVER_ARGS)
    p.add_argument("--server-cmd", default=DEFAULT_SERVER_CMD)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--trace-path", type=Path, default=TRACE)
    p.add_argument("--predictor", type=Path, default=PREDICTOR,
                   help="Fitted multiplex latency predictor (passed as --mux-predictor).")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="Recorded probes: skipped, and the searches' state.")
    p.add_argument("--out", type=Path,
                   help="Write new records and server logs here instead of --results (a "
                   "device call's output folder); records in both count.")
    p.add_argument("--expect-gpu", default="H200",
                   help="Stop before any probe unless the first GPU's name contains this "
                   "(the probes' servers size codellama-34b's KV pool for an H200's memory; "
                   "'any': no check; no check on a host without nvidia-smi).")
    p.add_argument("--repeat", action="store_true",
                   help="Run each --probe again even when recorded (an A/B's second run): "
                   "the record goes to <probe>__rep<k>.json; the newest run decides the "
                   "search, and summary.md lists every run of a repeated probe.")


def _summarise_parser(sub) -> None:
    p = sub.add_parser("summarise", help="Attainment, goodput, missing probes, Figure 3, "
                       "README table, from every probe JSON.")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--out-dir", type=Path, help="Default: --results.")
    p.add_argument("--figure3-workloads", default="loogle")


def _import_parser(sub) -> None:
    p = sub.add_parser("import-legacy", help="Probe JSONs from the committed records that "
                       "match a probe's definition.")
    p.add_argument("--results", type=Path, default=RESULTS)
    p = sub.add_parser("import-call", help="A device call's --out folder: records, "
                       "timelines and server logs into --results (repeats renamed where "
                       "their names are taken, the device's output path as $OUT).")
    p.add_argument("folder", type=Path)
    p.add_argument("--label", required=True, help="Prefixes the server logs (call1, ...).")
    p.add_argument("--results", type=Path, default=RESULTS)


def cmd_run(args: argparse.Namespace) -> int:
    targets = [parse_probe(t) for t in args.probe]
    targets += [t for text in args.search for t in parse_search(text)]
    if not targets:
        raise SystemExit("nothing to run: give --probe and/or --search")
    if any(t.workload == "mooncake" for t in targets) and not args.trace_path.is_file():
        raise SystemExit(f"the Mooncake trace is not at {args.trace_path} (--trace-path)")
    if any(itl_target(t.config) for t in targets) and not args.predictor.is_file():
        raise SystemExit(f"no multiplex predictor at {args.predictor} (--predictor)")
    check_gpu(args.expect_gpu)
    budget = Budget(time.monotonic() + args.budget_s)
    opts = RunOptions(args.results, args.trace_path, args.predictor, args.model,
                      args.server_args, args.port, args.startup_s, args.max_probes, budget,
                      args.server_cmd, args.out, repeat=args.repeat)
    if args.repeat and args.search:
        raise SystemExit("--repeat repeats --probe targets; a --search goes on from its record")
    asyncio.run(run_targets(targets, opts))
    return 1 if opts.failed else 0


def cmd_summarise(args: argparse.Namespace) -> int:
    summarise(args.results, args.out_dir or args.results, args.figure3_workloads.split(","))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    for path in import_legacy(args.results):
        print(f"imported: {path}")
    return 0


def cmd_import_call(args: argparse.Namespace) -> int:
    for path in import_call(args.folder, args.results, args.label):
        print(f"imported: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for add in (_run_parser, _summarise_parser, _import_parser):
        add(sub)
    args = parser.parse_args(argv)
    handler = {"run": cmd_run, "summarise": cmd_summarise, "import-legacy": cmd_import,
               "import-call": cmd_import_call}
    return handler[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
