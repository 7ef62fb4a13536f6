"""Plots of ``sim_fleet.py`` results (simulated): per comparison, the share of requests
within the TTFT SLO minute by minute, one line per configuration, and the whole run's.

    python benchmarks/plot_sim_fleet.py benchmarks/results/sim_fleet_*.json \\
        --out-dir benchmarks/results/plots/sim_fleet
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def label(row: dict) -> str:
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
