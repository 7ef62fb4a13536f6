"""Plots of ``sim_fleet.py`` results (simulated): per comparison, the share of requests
within the TTFT SLO minute by minute, one line per configuration, and the whole run's.
A validation result (``validate_sim.py``, ``sim_validate_instance.py``) is drawn as
measured against simulated P50 / P99 of TTFT and TPOT.

    python benchmarks/plot_sim_fleet.py benchmarks/results/sim_fleet_*.json \\
        --out-dir benchmarks/results/plots/sim_fleet
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def label(row: dict) -> str:
    if "multiplex" in row:  # no ratio controller on either side of this comparison
        if not row["multiplex"]:
            return "pure P/D"
        model = row.get("multiplex_model") or "fixed"  # rows before the field: fixed factors
        return f"PD-multiplexing instances ({model} model)"
    parts = []
    if "dispatch" in row:
        parts.append(row["dispatch"])
    if "pooled" in row:
        parts.append("one pool" if row["pooled"] else "group per scenario")
    if "dynamic" in row and "dispatch" not in row:
        parts.append("dynamic ratio" if row["dynamic"] else "static ratio")
    return ", ".join(parts) or "fleet"


def plot(path: Path, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(path.read_text())
    if result.get("kind") == "validation" and "probes" in result:
        return plot_probes(plt, result, path, out_dir)
    if result.get("kind") == "validation":
        return plot_validation(plt, result, path, out_dir)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for row in result["rows"]:
        minutes = [m for m, requests, _ in row["by_minute"] if requests]
        share = [met / requests for _, requests, met in row["by_minute"] if requests]
        ax.plot(minutes, share, label=f"{label(row)}: {row['slo_attainment']:.1%} overall")
    ax.set_xlabel("simulated minute")
    ax.set_ylabel(f"within TTFT SLO ({result['config']['ttft_slo_s']:.0f} s)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Simulated: {result['num_instances']} instances, "
                 f"{result['rows'][0]['scenarios']} scenarios, {path.stem}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = out_dir / f"{path.stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SIDES = {"measured": "measured", "simulated": "simulated, measured spread",
         "simulated_medians_only": "simulated, medians only",
         "simulated_without_shared_cores": "simulated, spread, cores not shared",
         "simulated_planner": "simulated, planner model, spread",
         "simulated_steps": "simulated, step model, one correction",
         "simulated_steps_probe_timing": "simulated, step model, the probes' steps"}


def plot_validation(plt, result: dict, path: Path, out_dir: Path) -> Path:
    """One panel per run and metric: P50 and P99, measured beside each simulation."""
    runs = result.get("schedules") or result.get("runs") or {"P/D group": result}
    fig, axes = plt.subplots(len(runs), 2, figsize=(8, 2.8 * len(runs)), squeeze=False)
    for row, (name, run) in zip(axes, runs.items(), strict=True):
        for ax, key in zip(row, ("ttft_s", "tpot_s"), strict=True):
            table = run.get("compare", run)[key]  # a re-simulation keeps the table bare
            sides = [side for side in SIDES if side in table]  # older results have fewer
            width = 0.8 / len(sides)
            for i, side in enumerate(sides):
                values = [table[side][q] * 1e3 for q in ("p50", "p99")]
                ax.bar([x + width * (i - (len(sides) - 1) / 2) for x in (0, 1)], values, width,
                       label=SIDES[side])
            ax.set_xticks([0, 1], ["P50", "P99"])
            ax.set_ylabel(f"{key[:-2].upper()} (ms)")
            ax.set_title(f"{name}:\nmeasured against simulated", fontsize=9)
        row[0].legend(fontsize=7)  # runs may differ in the simulations they hold
    fig.tight_layout()
    out = out_dir / f"{path.stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_probes(plt, result: dict, path: Path, out_dir: Path) -> Path:
    """A held-out check (``sim_goodput_probes.py``): simulated (measured spread) against
    measured P50 / P99 of TTFT and TPOT, one point per probe and percentile, coloured by
    chunk size, beside the diagonal and its 10% band."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    chunks = sorted({probe["chunk_size"] for probe in result["probes"].values()})
    colours = dict(zip(chunks, plt.rcParams["axes.prop_cycle"].by_key()["color"],
                       strict=False))
    for ax, key in zip(axes, ("ttft_s", "tpot_s"), strict=True):
        values = []
        for probe in result["probes"].values():
            table = probe["compare"][key]
            for quantile, marker in (("p50", "o"), ("p99", "^")):
                measured, simulated = table["measured"][quantile], table["simulated"][quantile]
                values += [measured, simulated]
                ax.scatter(measured, simulated, marker=marker, s=22,
                           color=colours[probe["chunk_size"]])
        low, high = min(values) * 0.8, max(values) * 1.2
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        for factor in (0.9, 1.1):
            ax.plot([low, high], [low * factor, high * factor], color="grey", linewidth=0.6,
                    linestyle="--")
        if key == "ttft_s":  # TTFT spans three decades, TPOT less than one
            ax.set_xscale("log")
            ax.set_yscale("log")
            for axis in (ax.xaxis, ax.yaxis):  # plain numbers
                axis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(f"measured {key[:-2].upper()} (s)")
        ax.set_ylabel(f"simulated {key[:-2].upper()} (s)")
    for chunk in chunks:
        axes[0].scatter([], [], color=colours[chunk], label=f"chunk {chunk}")
    axes[0].scatter([], [], marker="o", color="black", label="P50")
    axes[0].scatter([], [], marker="^", color="black", label="P99")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Simulated against measured, {len(result['probes'])} H200 goodput probes "
                 f"(fit: {result['model_from']}; dashed: 10%)", fontsize=8)
    fig.tight_layout()
    out = out_dir / f"{path.stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/plots/sim_fleet"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for path in args.results:
        print(plot(path, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
