"""What a mixed step's token count costs past a graph bucket, read from committed step
timelines (no GPU): per prompt token by prefix band, how many steps end past a bucket, and
how the steps that end on one sit against a line fitted through the others.

Each timeline is an engine's step record kept beside a goodput probe
(``<record>_timeline.json.gz``; ``pdserve.sched.steps``): mixed steps (``mixed`` for
chunked prefill, ``temporal`` for multiplexing) on the prefill-step graphs with one prompt
piece, each with its prompt tokens, prefix, decode batch and device time. A step of
``n`` prompt tokens beside ``b`` decodes replays the graph of the next bucket of
``--bucket`` tokens at or above ``n + b``::

    G=benchmarks/results/goodput_h200
    python benchmarks/step_alignment.py \\
        --timeline chunk256=$G/loogle__chunk256__r0.65_timeline.json.gz \\
        --timeline b2=$G/<B2 record at 0.65>_timeline.json.gz \\
        --out benchmarks/results/step_alignment_loogle_f67d252.json

The line (``on_bucket``): device time against the step's tokens, prompt tokens times prefix
and the decodes' KV tokens, least squares over a timeline's steps that end past a bucket;
the steps that end on one, over it. A re-analysis of GPU measurements, not a measurement.

``attention_waves``: the prompt's attention priced as waves of programs times the prefix
(the extend kernel runs one program per SM at the H200's tiles: a chunk of ``t`` query
tiles is ``t`` x q heads programs, in whole waves of ``--sms``) against the same line with
prompt tokens times prefix, fitted over every step, and each fit's residual by tile count.
``--extend-splits auto`` counts the prefix splits the kernel's rule launches (timelines
from 389e8ea on); ``1`` (the default) as the kernel ran before.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout

from pdserve.bench.report import result_header, write_json  # noqa: E402
from pdserve.bench.timeline import load_engine_timeline  # noqa: E402

MIXED_MODES = ("mixed", "temporal")
BANDS = ((0, 4000), (4000, 8000), (8000, 12000), (12000, 16000), (16000, 24576))


def mixed_steps(timeline: list[dict]) -> np.ndarray:
    """(prefix, prompt tokens, decodes, decode KV tokens, device ms) of each mixed step on
    the prefill-step graphs with one prompt piece."""
    rows = [(*entry["prefill_pieces"][0], entry["decode_batch"],
             entry.get("decode_context_tokens", 0), entry["measured_device_ms"])
            for entry in timeline
            if entry.get("mode") in MIXED_MODES and entry.get("path") == "piecewise_graph"
            and len(entry.get("prefill_pieces") or []) == 1]
    return np.asarray(rows, dtype=float).reshape(-1, 5)


def by_band(steps: np.ndarray) -> list[dict]:
    """Per prefix band: steps, median prompt tokens and device ms, and microseconds per
    prompt token (the band's device time over its prompt tokens)."""
    found = []
    for low, high in BANDS:
        band = steps[(steps[:, 0] >= low) & (steps[:, 0] < high)]
        if len(band):
            found.append({"prefix": [low, high], "steps": len(band),
                          "prompt_tokens_p50": float(np.median(band[:, 1])),
                          "device_ms_p50": float(np.median(band[:, 4])),
                          "us_per_prompt_token": float(band[:, 4].sum() / band[:, 1].sum() * 1e3)})
    return found


def on_bucket(steps: np.ndarray, bucket: int) -> dict:
    """How many steps end past a bucket, by how much; and the steps on one against the
    line through the others (None where either side is empty)."""
    prefix, tokens, decodes, kv, device_ms = steps.T
    total = tokens + decodes
    past = total % bucket
    census = {str(int(k)): int(np.sum(past == k)) for k in np.unique(past)}
    features = np.column_stack([np.ones_like(total), total, tokens * prefix, kv])
    off = past != 0
    found = {"bucket": bucket, "tokens_past_a_bucket": census,
             "share_past_a_bucket": float(np.mean(off))}
    if off.sum() < features.shape[1] or not (~off).any():
        return {**found, "on_bucket_over_line": None}
    coef, *_ = np.linalg.lstsq(features[off], device_ms[off], rcond=None)
    ratio = device_ms[~off] / (features[~off] @ coef)
    return {**found, "line": coef.tolist(), "on_bucket_steps": int((~off).sum()),
            "on_bucket_totals": sorted({int(t) for t in total[~off]}),
            "on_bucket_over_line_p50": float(np.median(ratio)),
            "past_bucket_over_line_p50": float(np.median(device_ms[off] / (features[off] @ coef)))}


def attention_waves(steps: np.ndarray, sms: int, q_heads: int, block_m: int,
                    auto_splits: bool) -> dict:
    """The two fits of device time (constant, tokens, attention term, decodes, decode KV
    tokens): attention as prompt tokens x prefix, or as waves x prefix; their relative RMS
    error and median residual by the chunk's tile count."""
    prefix, tokens, decodes, kv, device_ms = steps.T
    tiles = np.ceil(tokens / block_m)
    splits = _splits(tiles * q_heads, prefix, auto_splits)
    waves = np.ceil(tiles * q_heads * splits / sms) / splits
    fits = {}
    for name, attention in (("tokens_x_prefix", tokens * prefix / 1e3),
                            ("waves_x_prefix", waves * prefix / 1e3)):
        features = np.column_stack([np.ones_like(tokens), tokens, attention, decodes, kv / 1e3])
        coef, *_ = np.linalg.lstsq(features, device_ms, rcond=None)
        ratio = device_ms / (features @ coef)
        fits[name] = {"coef": coef.tolist(), "rms_relative_error": float(np.sqrt(np.mean(
            (ratio - 1) ** 2))), "residual_p50_by_tiles": {
            str(int(t)): float(np.median(ratio[tiles == t])) for t in np.unique(tiles)}}
    return {"sms": sms, "q_heads": q_heads, "block_m": block_m, "auto_splits": auto_splits,
            "steps_by_tiles": {str(int(t)): int(np.sum(tiles == t)) for t in np.unique(tiles)},
            "fits": fits}


def _splits(programs: np.ndarray, prefix: np.ndarray, auto: bool) -> np.ndarray:
    if not auto:
        return np.ones_like(programs)
    from pdserve.ops.triton_attention import extend_kv_splits  # the kernel's own rule

    cpu = torch.device("cpu")  # counted as the H200's 132 SMs
    return np.array([extend_kv_splits(0, int(p), int(x), cpu) for p, x in zip(programs, prefix,
                                                                            strict=True)])


def named_path(text: str) -> tuple[str, Path]:
    name, _, path = text.partition("=")
    if not path:
        raise argparse.ArgumentTypeError(f"--timeline {text!r}: want NAME=PATH")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeline", type=named_path, action="append", required=True,
                        help="NAME=PATH of a step timeline (repeatable)")
    parser.add_argument("--bucket", type=int, default=16,
                        help="the prefill-step graphs' bucket, in tokens")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--q-heads", type=int, default=64, help="codellama-34b's")
    parser.add_argument("--block-m", type=int, default=128, help="the extend kernel's tile")
    parser.add_argument("--extend-splits", choices=("1", "auto"), default="1",
                        help="prefix splits the timelines' extend kernel launched")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.extend_splits == "auto" and args.sms != 132:
        parser.error("--extend-splits auto counts the H200's 132 SMs (the rule on a CPU)")
    result = {}
    for name, path in args.timeline:
        steps = mixed_steps(load_engine_timeline(path))
        result[name] = {"timeline": path.as_posix(), "steps": len(steps),
                        "by_prefix": by_band(steps), **on_bucket(steps, args.bucket),
                        "attention_waves": attention_waves(steps, args.sms, args.q_heads,
                                                           args.block_m,
                                                           args.extend_splits == "auto")}
        bands = ", ".join(f"{b['prefix'][0] // 1000}-{b['prefix'][1] // 1000}K "
                          f"{b['us_per_prompt_token']:.0f} us" for b in result[name]["by_prefix"])
        print(f"{name}: {len(steps)} steps, {result[name]['share_past_a_bucket']:.0%} past a "
              f"bucket; per prompt token {bands}")
    config = {"timelines": {name: path.as_posix() for name, path in args.timeline},
              "bucket": args.bucket, "sms": args.sms, "q_heads": args.q_heads,
              "block_m": args.block_m, "extend_splits": args.extend_splits}
    write_json({**result_header(config), "kind": "analysis", "timelines": result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
