"""Recorded engine steps against the chunked instance model, step by step
(``step_check``): each step of a served run's step timeline (``pdserve.sched.steps``) beside
``recorded_step_s`` for its shape, summed and per (mode, path, decode batch band).

In an overloaded run the queue turns a few percent of step time into tens of percent of
TTFT, and per-request latencies cannot say which steps the model gets wrong; this can.
Used by ``benchmarks/sim_goodput_probes.py --steps`` (goodput probes) and
``benchmarks/sim_validate_instance.py`` (the validation's chunked replay).
"""

from __future__ import annotations

import numpy as np

from pdserve.sim.cluster import LatencyModel
from pdserve.sim.instance import recorded_step_s

# Decode batch bands of the step check: where the weights stop dominating a step, and the
# decode graphs' sizes, fall in different bands.
BATCH_BANDS = (0, 8, 32, 64, 128, 256)


def batch_band(batch: int) -> str:
    """The band of ``batch`` in ``BATCH_BANDS``: "0", "1-8", ..., "257+"."""
    if batch == 0:
        return "0"
    for low, high in zip(BATCH_BANDS, BATCH_BANDS[1:], strict=False):
        if batch <= high:
            return f"{low + 1}-{high}"
    return f"{BATCH_BANDS[-1] + 1}+"


# A multiplexing engine's decisions that ran one whole-GPU step, by the name the chunked
# engine's steps of that kind have.
WHOLE_GPU_MODES = {"temporal": "mixed", "decode_only": "decode_only"}


def whole_gpu_steps(timeline: list[dict]) -> list[dict]:
    """The entries a step model prices: every step of a chunked or prefill-first engine's
    timeline; of a multiplexing engine's, the decisions that ran one whole-GPU step (mixed
    steps and decode alone), renamed as the chunked engine names its steps; decisions of an
    engine that did not record their shape yet (no ``decode_context_tokens``) are left out."""
    if not any("decode_sms" in e for e in timeline):
        return timeline
    return [{**e, "mode": WHOLE_GPU_MODES[e["mode"]]} for e in timeline
            if e["mode"] in WHOLE_GPU_MODES and "decode_context_tokens" in e]


def step_check(model: LatencyModel, extra_s: float, timeline: list[dict]) -> dict:
    """Each recorded step's measured time (on the GPU's clock where there was one, else
    the host's) beside the model's for its shape, over the whole run and per group of
    (mode, path, decode batch band): the sums (a queue runs on the sum) and the median,
    p10 and p90 of measured over modelled (``whole_gpu_steps`` of ``timeline``)."""
    rows = []
    for entry in whole_gpu_steps(timeline):
        measured = entry["measured_device_ms"] or entry["measured_cycle_ms"]
        if measured > 0:
            band = batch_band(entry["decode_batch"])
            rows.append({"group": (entry["mode"], entry.get("path", ""), band),
                         "measured_ms": measured, "on_device": entry["measured_device_ms"] > 0,
                         "modelled_ms": recorded_step_s(model, entry, extra_s) * 1e3})
    if not rows:
        return {"steps": 0}
    groups = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    return {**step_totals(rows), "clock": step_clock(rows),
            "groups": [{"mode": mode, "path": path, "decode_batch": band,
                        **step_totals(members)}
                       for (mode, path, band), members in sorted(groups.items())]}


def step_totals(rows: list[dict]) -> dict:
    measured = np.array([r["measured_ms"] for r in rows])
    modelled = np.array([r["modelled_ms"] for r in rows])
    ratio = measured / modelled
    return {"steps": len(rows), "measured_s": float(measured.sum() / 1e3),
            "modelled_s": float(modelled.sum() / 1e3),
            "measured_over_modelled": float(measured.sum() / modelled.sum()),
            "measured_ms_p50": float(np.median(measured)),
            "modelled_ms_p50": float(np.median(modelled)),
            "ratio_p10_p50_p90": [float(np.quantile(ratio, q)) for q in (0.1, 0.5, 0.9)]}


def step_clock(rows: list[dict]) -> str:
    """Which clock timed the steps: "device", "host", or "both" (some steps each)."""
    on_device = {r["on_device"] for r in rows}
    return "both" if len(on_device) == 2 else "device" if True in on_device else "host"
