"""Plots of benchmark results (matplotlib, PNG, no display needed).

- ``tradeoff``: P99 TTFT against P99 ITL, one point per configuration; the SLO region is
  shaded and points inside it are filled.
- ``attainment``: SLO attainment against request rate per configuration (goodput probes).
- ``timeline``: batch sizes (and SM split, when the engine reports it) over one run.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run on machines without a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from pdserve.bench.report import measured_runs  # noqa: E402

_PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


def _workload_name(run: dict) -> str:
    return run["workload"].get("label") or run["workload"]["dataset"]


def _by_workload(result: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for run in measured_runs(result):
        groups.setdefault(_workload_name(run), []).append(run)
    return groups


def _meets(run: dict, slo: dict) -> bool:
    ttft, itl = run["ttft_ms"]["p99"], run["itl_ms"]["p99"]
    if ttft is None or itl is None:
        return False
    return (slo.get("ttft_ms") is None or ttft <= slo["ttft_ms"]) and (
        slo.get("itl_ms") is None or itl <= slo["itl_ms"])


def plot_tradeoff(runs: list[dict], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    slo = runs[0].get("slo") or {}
    if slo.get("itl_ms") is not None:
        ax.axvline(slo["itl_ms"], color="green", linestyle="--", label="ITL SLO")
    if slo.get("ttft_ms") is not None:
        ax.axhline(slo["ttft_ms"], color="green", linestyle=":", label="TTFT SLO")
    for run in runs:
        x, y = run["itl_ms"]["p99"], run["ttft_ms"]["p99"]
        if x is None or y is None:
            continue
        ok = _meets(run, slo)
        ax.scatter([x], [y], s=60, edgecolors="black",
                   facecolors="tab:green" if ok else "white", zorder=3)
        ax.annotate(run.get("name", "run"), (x, y), textcoords="offset points", xytext=(5, 5))
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(_PLAIN)
        axis.set_minor_formatter(_PLAIN)
    _shade_slo_region(ax, slo)
    ax.set_xlabel("P99 ITL (ms)")
    ax.set_ylabel("P99 TTFT (ms)")
    ax.set_title(f"{title}: filled = meets both SLOs at P99")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    return _save(fig, path)


def _shade_slo_region(ax, slo: dict) -> None:
    """Shades the box both SLOs allow, without letting the shading move the axis limits."""
    xlim, ylim = ax.get_xlim(), ax.get_ylim()
    right = slo.get("itl_ms") or xlim[1]
    top = slo.get("ttft_ms") or ylim[1]
    ax.fill_between([xlim[0], right], ylim[0], top, color="green", alpha=0.08)
    ax.set_xlim(xlim)
    ax.set_ylim(ylim)


def plot_attainment(runs: list[dict], path: Path, title: str) -> Path | None:
    probed = [r for r in runs if r.get("goodput", {}).get("points")]
    if not probed:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for run in probed:
        curve = sorted((p["rate"], p["attainment"]) for p in run["goodput"]["points"])
        label = f"{run.get('name', 'run')} (goodput {run.get('goodput_rps', 0):.3g})"
        ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], marker="o", label=label)
    target = probed[0]["goodput"].get("target", 0.9)
    ax.axhline(100 * target, color="gray", linestyle="--", label=f"{100 * target:.0f}% target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    return _save(fig, path)


def _is_secondary(name: str) -> bool:
    """SM counts and 0..1 shares go on the right axis: they would flatten the batch sizes."""
    lower = name.lower().replace("_sum", "")
    return "sm" in lower or "ratio" in lower or "usage" in lower


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    scale = 100.0 if "ratio" in key or "usage" in key else 1.0
    points = [(s["t"], s[key] * scale) for s in samples if key in s]
    return [p[0] for p in points], [p[1] for p in points]


def plot_timeline(run: dict, path: Path, title: str) -> Path | None:
    samples = run.get("timeline") or []
    keys = sorted({k for s in samples for k in s if k != "t"})
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    right = ax.twinx() if any(_is_secondary(k) for k in keys) else None
    for index, key in enumerate(keys):
        target = right if right is not None and _is_secondary(key) else ax
        target.step(*_series(samples, key), where="post", label=key, color=f"C{index}")
    ax.set_xlabel("time since start of run (s)")
    ax.set_ylabel("requests / tokens")
    if right is not None:
        right.set_ylabel("SMs / % (shares)")
        right.set_ylim(bottom=0)  # an SM split reads as a share of the whole GPU
        right.legend(loc="upper right", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


ENGINE_SERIES = ("decode_batch", "prefill_tokens", "decode_sms", "prefill_sms")


def plot_engine_timeline(run: dict, path: Path, title: str) -> Path | None:
    """The SM split and batch sizes of every engine decision (multiplex mode)."""
    entries = run.get("engine_timeline") or []
    samples = [{"t": e["t"], **{k: e[k] for k in ENGINE_SERIES if k in e}} for e in entries]
    return plot_timeline({"timeline": samples}, path, f"{title}: SM split") if samples else None


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def plot_all(result: dict, out_dir: str | Path) -> list[Path]:
    """Every plot the result supports, one PNG each, under ``out_dir``."""
    out_dir = Path(out_dir)
    written: list[Path | None] = []
    for workload, runs in _by_workload(result).items():
        slug = _slug(workload)
        written.append(plot_tradeoff(runs, out_dir / f"tradeoff_{slug}.png", workload))
        written.append(plot_attainment(runs, out_dir / f"attainment_{slug}.png", workload))
        for run in runs:
            name = f"{run.get('name', 'run')} / {workload}"
            written.append(plot_timeline(
                run, out_dir / f"timeline_{_slug(run.get('name', 'run'))}_{slug}.png", name))
            written.append(plot_engine_timeline(
                run, out_dir / f"split_{_slug(run.get('name', 'run'))}_{slug}.png", name))
    return [p for p in written if p is not None]
