"""``bench_engine.py`` of this tree and of an earlier revision, alternated in one call on one
machine (machines of one GPU type differ by several percent, so an engine change is judged
only against its baseline run beside it).

Where the checkout has git, put the earlier revision's package beside the tree (the GPU
machine gets the working tree without ``.git``, so this runs before the call):

    python benchmarks/ab_engine.py prepare d36edd5 --dir ab_baseline

then, on the GPU machine, the runs (new, old, new, old, ...) and one record of them all:

    python benchmarks/ab_engine.py run --baseline-dir ab_baseline --runs 2 \\
        --out $OUT/engine_ab.json -- --models codellama-34b --overlap on \\
        --decode-batches 1,16,48,128,256 --decode-contexts 1024 --prefill-lengths none

Each run is a process of its own running this tree's ``bench_engine.py``, with its side's
package first on ``PYTHONPATH`` and ``PDSERVE_GIT_REVISION`` naming its revision (this
tree's from ``--revision``, else git).
The record keeps every run whole, in the order they ran, and the ratio of the medians of
the new runs over the old ones at each decode and prefill point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REVISION_FILE = "REVISION"


def prepare(revision: str, directory: Path) -> str:
    """``pdserve/`` of ``revision`` extracted into ``directory``, its full hash beside it."""
    full = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    directory.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", full, "pdserve"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(directory, filter="data")
    (directory / REVISION_FILE).write_text(full + "\n")
    return full


def run_once(bench_args: list[str], package_root: Path, revision: str, out: Path,
             bench: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package_root), "PDSERVE_GIT_REVISION": revision}
    subprocess.run([sys.executable, str(bench), *bench_args, "--out", str(out)], env=env,
                   check=True)
    return json.loads(out.read_text())


def alternate(bench_args: list[str], baseline_dir: Path, new_revision: str, runs: int,
              bench: Path, scratch: Path) -> dict:
    """``runs`` pairs, new then old; every run's record by name, in order."""
    old_revision = (baseline_dir / REVISION_FILE).read_text().strip()
    records = {}
    for run in range(1, runs + 1):
        for side, root, revision in (("new", ROOT, new_revision),
                                     ("old", baseline_dir, old_revision)):
            name = f"{side}_run{run}"
            records[name] = run_once(bench_args, root, revision, scratch / f"{name}.json",
                                     bench)
    return {"kind": "ab", "new_revision": new_revision, "old_revision": old_revision,
            "order": list(records), "runs": records, "ratios": ratios(records)}


def ratios(records: dict) -> list[dict]:
    """New over old at each point, medians over the runs of each side: decode step time
    and prefill seconds (below 1: the new tree is faster)."""
    times: dict[tuple, dict[str, list[float]]] = {}
    for name, record in records.items():
        side = name.split("_")[0]
        for model in record["models"]:
            for row in model.get("decode", []):
                key = ("decode", model["model"], row["batch"], row["context"],
                       row.get("long_context", 0), row.get("overlap"))
                times.setdefault(key, {"new": [], "old": []})[side].append(row["step_ms"])
            for row in model.get("prefill", []):
                key = ("prefill", model["model"], row["tokens"])
                times.setdefault(key, {"new": [], "old": []})[side].append(row["seconds"])
    out = []
    for key, sides in times.items():
        if sides["new"] and sides["old"]:
            new, old = statistics.median(sides["new"]), statistics.median(sides["old"])
            out.append({"point": list(key), "new": new, "old": old, "new_over_old": new / old})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="extract a revision's package (needs git)")
    prep.add_argument("revision")
    prep.add_argument("--dir", type=Path, required=True)
    run = commands.add_parser("run", help="alternate bench_engine.py runs of both trees")
    run.add_argument("--baseline-dir", type=Path, required=True)
    run.add_argument("--revision", default=os.environ.get("PDSERVE_GIT_REVISION"),
                     help="this tree's revision (default: $PDSERVE_GIT_REVISION, else git)")
    run.add_argument("--runs", type=int, default=2, help="pairs of runs, new then old")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--bench", type=Path, default=HERE / "bench_engine.py",
                     help=argparse.SUPPRESS)
    run.add_argument("bench_args", nargs=argparse.REMAINDER,
                     help="after --: bench_engine.py's arguments (not --out)")
    args = parser.parse_args()
    if args.command == "prepare":
        print(prepare(args.revision, args.dir))
        return
    bench_args = [a for a in args.bench_args if a != "--"]
    if "--out" in bench_args:
        parser.error("give --out to ab_engine.py, not to bench_engine.py")
    revision = args.revision or subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not revision:
        parser.error("no git here: name this tree's revision with --revision")
    with tempfile.TemporaryDirectory() as scratch:
        record = alternate(bench_args, args.baseline_dir.resolve(), revision, args.runs,
                           args.bench, Path(scratch))
    record["command"] = " ".join(["python", "benchmarks/ab_engine.py", *sys.argv[1:]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for row in record["ratios"]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
