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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

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
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = {}
    for name, path in args.timeline:
        steps = mixed_steps(load_engine_timeline(path))
        result[name] = {"timeline": path.as_posix(), "steps": len(steps),
                        "by_prefix": by_band(steps), **on_bucket(steps, args.bucket)}
        bands = ", ".join(f"{b['prefix'][0] // 1000}-{b['prefix'][1] // 1000}K "
                          f"{b['us_per_prompt_token']:.0f} us" for b in result[name]["by_prefix"])
        print(f"{name}: {len(steps)} steps, {result[name]['share_past_a_bucket']:.0%} past a "
              f"bucket; per prompt token {bands}")
    config = {"timelines": {name: path.as_posix() for name, path in args.timeline},
              "bucket": args.bucket}
    write_json({**result_header(config), "kind": "analysis", "timelines": result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
