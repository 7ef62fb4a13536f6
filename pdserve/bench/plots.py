"""Plots of benchmark results (PNG, no display needed; matplotlib: ``pdserve[bench]``).

- ``tradeoff``: P99 TTFT against P99 ITL, one point per configuration; with SLOs, the region
  both allow is shaded and points meeting both are filled.
- ``latency_cdf``: the distribution of TTFT (per request) and ITL (per token) per configuration.
- ``attainment``: SLO attainment against request rate per configuration (goodput probes).
- ``timeline``: the polled gauges over one run, one panel per unit (requests, tokens, SMs,
  shares), series that stay at zero left out.
- ``split``: the engine's own SM-split decisions over one run (multiplex), drawn the same way.

Legends sit to the right of the axes, never over the data.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: benchmarks run on machines without a display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

from pdserve.bench.report import measured_runs, workload_label  # noqa: E402

LOG_SPAN = 20.0
"""Axes whose values span more than this factor are drawn on a log scale."""
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0,
                  "fontsize": "small"}
_PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


def _minor_label(value: float, _) -> str:
    """Labels the 2s and 5s between decades only: every minor tick labelled is unreadable."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(mantissa) in (2, 5) else ""


def _scale(ax, which: str, values: list[float | None]) -> None:
    """Log scale (``which``: "x" or "y") with plain labels when the values span decades,
    else the linear default."""
    positive = [v for v in values if v is not None and v > 0]
    if not positive or max(positive) / min(positive) <= LOG_SPAN:
        return
    getattr(ax, f"set_{which}scale")("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(_PLAIN)
    # Over more than two decades the 2s and 5s crowd the decade labels.
    few_decades = max(positive) / min(positive) <= 100
    axis.set_minor_formatter(FuncFormatter(_minor_label) if few_decades else NullFormatter())


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**LEGEND_OUTSIDE)


def _by_workload(result: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for run in measured_runs(result):
        groups.setdefault(workload_label(run), []).append(run)
    return groups


def _has_slo(slo: dict) -> bool:
    return slo.get("ttft_ms") is not None or slo.get("itl_ms") is not None


def _meets(run: dict, slo: dict) -> bool:
    ttft, itl = run["ttft_ms"]["p99"], run["itl_ms"]["p99"]
    if ttft is None or itl is None:
        return False
    return (slo.get("ttft_ms") is None or ttft <= slo["ttft_ms"]) and (
        slo.get("itl_ms") is None or itl <= slo["itl_ms"])


# --- P99 trade-off ------------------------------------------------------------------------------

def plot_tradeoff(runs: list[dict], path: Path, title: str) -> Path | None:
    fig = tradeoff_figure(runs, title)
    return None if fig is None else _save(fig, path)


def tradeoff_figure(runs: list[dict], title: str):
    points = [(run, run["itl_ms"]["p99"], run["ttft_ms"]["p99"]) for run in runs
              if run["itl_ms"]["p99"] is not None and run["ttft_ms"]["p99"] is not None]
    if not points:
        return None
    slo = runs[0].get("slo") or {}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for index, (run, x, y) in enumerate(points):
        hollow = _has_slo(slo) and not _meets(run, slo)
        ax.scatter([x], [y], s=70, zorder=3, color=f"C{index}", label=run.get("name", "run"),
                   facecolors="white" if hollow else f"C{index}", linewidths=2)
    _scale(ax, "x", [p[1] for p in points] + [slo.get("itl_ms")])
    _scale(ax, "y", [p[2] for p in points] + [slo.get("ttft_ms")])
    _draw_slo(ax, slo)
    ax.set_xlabel("P99 ITL (ms)")
    ax.set_ylabel("P99 TTFT (ms)")
    ax.set_title(f"{title}: P99 latency per configuration")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    return fig


def _draw_slo(ax, slo: dict) -> None:
    """SLO lines, the shaded region both allow, and what filled / hollow points mean."""
    if not _has_slo(slo):
        return
    if slo.get("itl_ms") is not None:
        ax.axvline(slo["itl_ms"], color="green", linestyle="--", label="ITL SLO")
    if slo.get("ttft_ms") is not None:
        ax.axhline(slo["ttft_ms"], color="green", linestyle=":", label="TTFT SLO")
    _shade_slo_region(ax, slo)
    for filled, text in ((True, "meets both SLOs at P99"), (False, "misses an SLO at P99")):
        ax.add_line(Line2D([], [], marker="o", linestyle="", color="gray", label=text,
                           markerfacecolor="gray" if filled else "white", markersize=8))


def _shade_slo_region(ax, slo: dict) -> None:
    """Shades the box both SLOs allow, without letting the shading move the axis limits."""
    xlim, ylim = ax.get_xlim(), ax.get_ylim()
    right = slo.get("itl_ms") or xlim[1]
    top = slo.get("ttft_ms") or ylim[1]
    ax.fill_between([xlim[0], right], ylim[0], top, color="green", alpha=0.08)
    ax.set_xlim(xlim)
    ax.set_ylim(ylim)


# --- latency distributions ----------------------------------------------------------------------

def _successful(run: dict) -> list[dict]:
    return [s for s in run.get("samples") or [] if s.get("success")]


def _cdf(ax, values: list[float], label: str, color: str) -> None:
    values = sorted(values)
    shares = [100.0 * (i + 1) / len(values) for i in range(len(values))]
    ax.step(values, shares, where="post", label=label, color=color)


def plot_latency_cdf(runs: list[dict], path: Path, title: str) -> Path | None:
    sampled = [run for run in runs if _successful(run)]
    if not sampled:
        return None
    fig, (ttft_ax, itl_ax) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    ttft_all, itl_all = [], []
    for index, run in enumerate(sampled):
        ttft = [s["ttft_ms"] for s in _successful(run) if s["ttft_ms"] is not None]
        itl = [gap for s in _successful(run) for gap in s["itl_ms"]]
        name = run.get("name", "run")
        for ax, values, store in ((ttft_ax, ttft, ttft_all), (itl_ax, itl, itl_all)):
            if values:
                _cdf(ax, values, name, f"C{index}")
                store.extend(values)
    slo = sampled[0].get("slo") or {}
    _finish_cdf(ttft_ax, ttft_all, slo.get("ttft_ms"), "TTFT (ms)", "requests (%)")
    _finish_cdf(itl_ax, itl_all, slo.get("itl_ms"), "ITL (ms)", "inter-token gaps (%)")
    ttft_ax.set_ylim(0, 101)
    fig.suptitle(f"{title}: latency distribution")
    _legend(itl_ax)
    return _save(fig, path)


def _finish_cdf(ax, values: list[float], slo_ms: float | None, xlabel: str,
                ylabel: str) -> None:
    if slo_ms is not None:
        ax.axvline(slo_ms, color="green", linestyle="--", label="SLO")
    _scale(ax, "x", values)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


# --- goodput probes -----------------------------------------------------------------------------

def plot_attainment(runs: list[dict], path: Path, title: str) -> Path | None:
    probed = [r for r in runs if r.get("goodput", {}).get("points")]
    if not probed:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for run in probed:
        curve = sorted((p["rate"], p["attainment"]) for p in run["goodput"]["points"])
        label = f"{run.get('name', 'run')} (goodput {run.get('goodput_rps', 0):.3g} req/s)"
        ax.plot([c[0] for c in curve], [100 * c[1] for c in curve], marker="o", label=label)
    target = probed[0]["goodput"].get("target", 0.9)
    ax.axhline(100 * target, color="gray", linestyle="--", label=f"{100 * target:.0f}% target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def plot_goodput_vs_slo(series: dict[str, list[tuple[float, float, float | None, bool]]],
                        path: Path, title: str) -> Path | None:
    """Goodput against the ITL (TPOT) SLO, one line per configuration: points
    ``(slo_ms, goodput, lowest failing rate or None, settled)``. A search still open is
    drawn hollow with a bar up to its lowest failing rate (an arrow when none failed)."""
    if not any(series.values()):
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for index, (name, points) in enumerate(series.items()):
        color = f"C{index}"
        # Lines join settled goodputs only: an open search's lower bound is not a value.
        settled = [p for p in points if p[3]]
        ax.plot([p[0] for p in settled], [p[1] for p in settled], color=color, marker="o",
                label=name)
        for slo, low, high, settled in points:
            _goodput_point(ax, slo, low, high, settled, color)
    ax.set_xlabel("ITL (TPOT) SLO (ms)")
    ax.set_ylabel("goodput (req/s at >= 90% attainment)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.add_line(Line2D([], [], marker="o", linestyle="", color="gray", markerfacecolor="white",
                       label="search not finished"))
    _legend(ax)
    return _save(fig, path)


def _goodput_point(ax, slo: float, low: float, high: float | None, settled: bool,
                   color: str) -> None:
    ax.scatter([slo], [low], s=50, zorder=3, color=color,
               facecolors=color if settled else "white", linewidths=2)
    if settled:
        return
    if high is None:
        ax.annotate("", xy=(slo, low * 1.25 + 0.01), xytext=(slo, low),
                    arrowprops={"arrowstyle": "->", "color": color})
    else:
        ax.vlines(slo, low, high, colors=color, linestyles=":")


# --- timelines ----------------------------------------------------------------------------------

UNITS = ("requests", "tokens", "SMs", "% (shares)")
_SM = re.compile(r"(^|_)sms?($|_)")


def series_unit(name: str) -> str:
    """What a timeline series counts, from its name: one panel (y axis) per unit, so request
    counts are never flattened on a token-count axis."""
    lower = name.lower()
    if "ratio" in lower or "usage" in lower:
        return "% (shares)"
    if _SM.search(lower):
        return "SMs"
    return "tokens" if "token" in lower else "requests"


def _series(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    scale = 100.0 if series_unit(key) == "% (shares)" else 1.0
    points = [(s["t"], s[key] * scale) for s in samples if key in s]
    return [p[0] for p in points], [p[1] for p in points]


def _numeric_keys(samples: list[dict]) -> list[str]:
    keys = {k for s in samples for k, v in s.items()
            if k != "t" and isinstance(v, int | float) and not isinstance(v, bool)}
    return sorted(keys)


def _short(name: str, keys: list[str]) -> str:
    """The name without the prefix every series shares (``pdserve_``), for shorter legends."""
    prefix = keys[0].split("_")[0] + "_"
    shared = len(keys) > 1 and all(k.startswith(prefix) for k in keys)
    return name[len(prefix):] if shared else name


def plot_timeline(run: dict, path: Path, title: str) -> Path | None:
    fig = timeline_figure(run.get("timeline") or [], title)
    return None if fig is None else _save(fig, path)


def timeline_figure(samples: list[dict], title: str):
    """One panel per unit of the non-zero series of ``samples``; None when all are zero."""
    keys = _numeric_keys(samples)
    drawn = [k for k in keys if any(s.get(k) for s in samples)]
    if not drawn:
        return None
    units = [u for u in UNITS if any(series_unit(k) == u for k in drawn)]
    fig, axes = plt.subplots(len(units), 1, figsize=(9, 1.2 + 2.2 * len(units)), sharex=True,
                             squeeze=False)
    for ax, unit in zip(axes[:, 0], units, strict=True):
        _timeline_panel(ax, unit, samples, [k for k in drawn if series_unit(k) == unit], keys)
    axes[-1, 0].set_xlabel("time since start of run (s)")
    axes[0, 0].set_title(title)
    zero = [_short(k, keys) for k in keys if k not in drawn]
    if zero:
        fig.text(0.01, 0.005, "always 0, not drawn: " + ", ".join(zero), fontsize="small",
                 va="bottom")
    return fig


def _timeline_panel(ax, unit: str, samples: list[dict], series: list[str],
                    keys: list[str]) -> None:
    for key in series:
        # Colour by position among all keys: a series keeps its colour across plots.
        ax.step(*_series(samples, key), where="post", label=_short(key, keys),
                color=f"C{keys.index(key)}")
    ax.set_ylabel(unit)
    ax.set_ylim(bottom=0)
    if unit != "% (shares)":  # counts: whole numbers only
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    _legend(ax)


ENGINE_SERIES = ("decode_batch", "prefill_tokens", "decode_sms", "prefill_sms")


def plot_engine_timeline(run: dict, path: Path, title: str) -> Path | None:
    """The SM split and batch sizes of every engine decision (multiplex), or the batch
    sizes of every step (chunked, prefill-first)."""
    entries = run.get("engine_timeline") or []
    samples = [{"t": e["t"], **{k: e[k] for k in ENGINE_SERIES if k in e}} for e in entries]
    what = "SM split" if any("decode_sms" in e for e in entries) else "steps"
    return plot_timeline({"timeline": samples}, path, f"{title}: {what}") if samples else None


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120, bbox_inches="tight")
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
        written.append(plot_latency_cdf(runs, out_dir / f"latency_cdf_{slug}.png", workload))
        written.append(plot_attainment(runs, out_dir / f"attainment_{slug}.png", workload))
        for run in runs:
            name = f"{run.get('name', 'run')} / {workload}"
            written.append(plot_timeline(
                run, out_dir / f"timeline_{_slug(run.get('name', 'run'))}_{slug}.png", name))
            written.append(plot_engine_timeline(
                run, out_dir / f"split_{_slug(run.get('name', 'run'))}_{slug}.png", name))
    return [p for p in written if p is not None]
