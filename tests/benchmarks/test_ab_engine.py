"""benchmarks/ab_engine.py: an earlier revision's package extracted, and runs of both trees
alternated into one record (a stand-in for bench_engine.py that reports which package it
imported; the real one needs a GPU)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ab_engine.py"

# Writes a bench_engine-shaped record: decode 10 ms with this tree's package, 12 ms with the
# baseline's (told apart by where pdserve was imported from), prefill 1 s on either.
STAND_IN = """
import json, os, sys
import pdserve
out = sys.argv[sys.argv.index("--out") + 1]
baseline = "baseline" in pdserve.__file__
row = {"batch": 16, "context": 1024, "overlap": True, "step_ms": 12.0 if baseline else 10.0}
record = {"git_revision": os.environ["PDSERVE_GIT_REVISION"], "argv": sys.argv[1:],
          "models": [{"model": "m", "decode": [row],
                      "prefill": [{"tokens": 8192, "seconds": 1.0}]}]}
open(out, "w").write(json.dumps(record))
"""


def _ab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, check=True,
                          capture_output=True, text=True)


def test_runs_alternate_each_on_its_package_and_revision(tmp_path):
    baseline = tmp_path / "baseline"
    shutil.copytree(ROOT / "pdserve", baseline / "pdserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (baseline / "REVISION").write_text("a" * 40 + "\n")
    stand_in = tmp_path / "bench.py"
    stand_in.write_text(STAND_IN)
    out = tmp_path / "ab.json"
    _ab("run", "--baseline-dir", str(baseline), "--revision", "b" * 40, "--runs", "2",
        "--out", str(out), "--bench", str(stand_in), "--", "--models", "m", cwd=tmp_path)
    record = json.loads(out.read_text())
    assert record["kind"] == "ab" and record["order"] == [
        "new_run1", "old_run1", "new_run2", "old_run2"]
    revisions = {name: run["git_revision"] for name, run in record["runs"].items()}
    assert revisions == {"new_run1": "b" * 40, "old_run1": "a" * 40,
                         "new_run2": "b" * 40, "old_run2": "a" * 40}
    assert all(run["argv"][:2] == ["--models", "m"] for run in record["runs"].values())
    by_point = {tuple(row["point"][:3]): row["new_over_old"] for row in record["ratios"]}
    assert by_point[("decode", "m", 16)] == pytest.approx(10 / 12)
    assert by_point[("prefill", "m", 8192)] == 1.0


def test_bench_engine_out_is_refused(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "run", "--baseline-dir", "x",
                             "--revision", "b", "--out", "o.json", "--", "--out", "p.json"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2 and "give --out to ab_engine.py" in result.stderr


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the repository's git history")
def test_prepare_extracts_a_revision_s_package(tmp_path):
    revision = _ab("prepare", "HEAD", "--dir", str(tmp_path / "old"), cwd=ROOT).stdout.strip()
    assert len(revision) == 40
    assert (tmp_path / "old" / "REVISION").read_text().strip() == revision
    shown = subprocess.run(["git", "show", f"{revision}:pdserve/ops/triton_attention.py"],
                           cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert (tmp_path / "old" / "pdserve" / "ops" / "triton_attention.py").read_text() == shown
