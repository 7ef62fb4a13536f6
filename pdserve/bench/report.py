"""Result records (JSON) and the human report (markdown table) of a benchmark."""

from __future__ import annotations

import datetime
import gzip
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULT_VERSION = 1
HEADER_KEYS = ("version", "created", "command", "git_revision", "device", "config", "model")


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def git_revision(root: Path | None = None) -> str:
    """HEAD of the checkout this package runs from, ``+dirty`` when it has local changes;
    ``PDSERVE_GIT_REVISION`` names it where the tree was copied without its ``.git`` or
    beside another commit's. A name that is this ``.git``'s HEAD while the tree differs
    from it gets ``+dirty`` too: it was read from the wrong ``.git``, not where the tree
    came from."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    named = os.environ.get("PDSERVE_GIT_REVISION")
    rev = _run(["git", "rev-parse", "HEAD"], root)
    if named and not (rev and rev.startswith(named)):
        return named
    if not rev:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return (named or rev) + ("+dirty" if dirty else "")


SOURCE_FOLDERS = ("pdserve", "benchmarks")
"""The code a result depends on; its digest names that code apart from any git metadata."""


def source_digest(root: Path | None = None) -> str:
    """SHA-256 over the Python sources under ``SOURCE_FOLDERS`` of the checkout this package
    runs from: each file's path and git blob id, sorted by path. It names the code that ran
    where the git metadata cannot (a tree copied beside a ``.git`` of another commit, or
    none); ``benchmarks/source_revision.py`` finds the commits whose tree has it."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    blobs = {}
    for folder in SOURCE_FOLDERS:
        for path in (root / folder).rglob("*.py"):
            data = path.read_bytes()
            blobs[path.relative_to(root).as_posix()] = hashlib.sha1(
                b"blob %d\0" % len(data) + data).hexdigest()
    return digest_of_blobs(blobs)


def digest_of_blobs(blobs: dict[str, str]) -> str:
    """``source_digest`` of a tree given as {path: git blob id} (a commit's ``git ls-tree``)."""
    listing = "".join(f"{path}\0{blob}\n" for path, blob in sorted(blobs.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


def revision_fields() -> dict[str, str]:
    """What names the code of a result: the git revision, and the sources' digest."""
    return {"git_revision": git_revision(), "source_digest": source_digest()}


# CUDA's own switches that change what a serving step costs (lazy kernel loading).
CUDA_VARIABLES = ("CUDA_MODULE_LOADING",)


def pdserve_environment() -> dict[str, str]:
    """The ``PDSERVE_*`` variables (and ``CUDA_VARIABLES``) a run was started with: several
    kernels are opt-in by environment variable, so a result must say which ran."""
    return {k: v for k, v in sorted(os.environ.items())
            if (k.startswith("PDSERVE_") and k != "PDSERVE_GIT_REVISION")
            or k in CUDA_VARIABLES}


def device_info() -> dict:
    """The GPUs of this host (servers started by ``compare`` run here), without importing torch."""
    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"])
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "gpus": [line.strip() for line in gpus.splitlines() if line.strip()]}


def gpu_name() -> str | None:
    """The first GPU's name as nvidia-smi reports it; None on a host without one."""
    names = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return names.splitlines()[0].strip() if names else None


def expected_gpu(named: str | None, model: str) -> str:
    """The GPU a benchmark of ``model`` is defined on, unless ``--expect-gpu`` named one:
    an H200 for codellama-34b (its 24,576-token KV pool), any for the others."""
    return named or ("H200" if model == "codellama-34b" else "any")


def check_gpu(expected: str, name_of_gpu=gpu_name) -> None:
    """Stop (SystemExit) when the GPU is not the one a benchmark is defined on, before it
    starts any server: on an 80 GB card codellama-34b at a 24,576-token context leaves no
    KV pool, so every server would fail after loading. ``any``: no check; none on a host
    without nvidia-smi (a CPU run of the tiny model)."""
    if expected == "any":
        return
    name = name_of_gpu()
    if name is not None and expected.lower() not in name.lower():
        raise SystemExit(f"the GPU is {name!r}, not an {expected}: this benchmark is defined "
                         f"on an {expected} (--expect-gpu any runs it anyway)")


def portable_command(parts: list[str]) -> list[str]:
    """A command as anyone would rerun it: this interpreter's install path is the host's own."""
    return ["python" if part == sys.executable else part for part in parts]


def result_header(config: dict) -> dict:
    return {
        "version": RESULT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": sys.argv,
        **revision_fields(),
        "device": device_info(),
        "environment_variables": pdserve_environment(),
        "config": config,
    }


def _clean(value):
    """JSON has no inf / nan: write them as strings rather than emit invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_layout(_clean(result)) + "\n")


def _layout(value, indent: str = "") -> str:
    """JSON with objects indented a space per level but a list of objects one object per
    line, and lists of numbers on one line: a run's per-request records stay readable line
    by line at half the size of fully indented JSON."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        fields = [f"{inner}{json.dumps(key)}: {_layout(item, inner)}"
                  for key, item in value.items()]
        return "{\n" + ",\n".join(fields) + f"\n{indent}}}"
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        rows = [inner + json.dumps(item) for item in value]
        return "[\n" + ",\n".join(rows) + f"\n{indent}]"
    return json.dumps(value)


def load_json(path: str | Path) -> Any:
    """A result file (or an engine timeline), gzip-compressed where its name ends in
    ``.gz`` (large committed results are kept compressed)."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


# --- text report ------------------------------------------------------------------------------

COLUMNS = (
    ("config", lambda r: r.get("name", "-")),
    ("workload", lambda r: workload_label(r)),
    ("rate", lambda r: _fmt(r.get("request_rate"))),
    ("req/s", lambda r: _fmt(r["request_throughput"])),
    ("out tok/s", lambda r: _fmt(r["output_token_throughput"])),
    ("TTFT p50", lambda r: _fmt(r["ttft_ms"]["p50"])),
    ("TTFT p99", lambda r: _fmt(r["ttft_ms"]["p99"])),
    ("ITL p50", lambda r: _fmt(r["itl_ms"]["p50"])),
    ("ITL p99", lambda r: _fmt(r["itl_ms"]["p99"])),
    ("TPOT p99", lambda r: _fmt(r["tpot_ms"]["p99"])),
    ("E2E p99", lambda r: _fmt(r["e2e_ms"]["p99"])),
    ("SLO", lambda r: f"{_fmt((r.get('slo') or {}).get('ttft_ms'))} / "
                      f"{_fmt((r.get('slo') or {}).get('itl_ms'))}"),
    ("SLO att.", lambda r: _pct(r.get("slo_attainment"))),
    ("goodput", lambda r: _fmt(r.get("goodput_rps"))),
    ("failed", lambda r: str(r.get("failed", 0))),
)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def runs_of(result: dict) -> list[dict]:
    """Every run record of a result: a compare result's ``runs``, or the single run itself."""
    if "runs" in result:
        return result["runs"]
    return [{"name": result.get("config", {}).get("name", "run"), **result}]


def merge_results(results: list[dict]) -> dict:
    """One result holding every run of ``results`` (the header of the first)."""
    if len(results) == 1:
        return results[0]
    head = {k: v for k, v in results[0].items() if k in HEADER_KEYS}
    head["merged_from"] = [{k: r.get(k) for k in ("created", "git_revision", "command")}
                           for r in results]
    return {**head, "runs": [run for r in results for run in runs_of(r)]}


def markdown_report(result: dict) -> str:
    lines = [f"# Benchmark ({result.get('created', '')}, rev {result.get('git_revision', '?')})",
             "", f"Device: {', '.join(result.get('device', {}).get('gpus') or ['cpu'])}. "
             "Latencies in ms; SLO = TTFT / TPOT limits; attainment counts failures as misses.",
             ""]
    lines.append("| " + " | ".join(name for name, _ in COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for run in runs_of(result):
        lines.append(_row(run))
    return "\n".join(lines) + "\n"


def workload_label(run: dict) -> str:
    return run["workload"].get("label") or run["workload"]["dataset"]


def _row(run: dict) -> str:
    if "error" in run:
        return f"| {run.get('name', '-')} | {workload_label(run)} | failed: {run['error'][:120]} |"
    return "| " + " | ".join(get(run) for _, get in COLUMNS) + " |"


def measured_runs(result: dict) -> list[dict]:
    """The runs that produced metrics (a configuration whose server failed has none)."""
    return [run for run in runs_of(result) if "error" not in run]


def print_summary(run: dict, title: str = "") -> None:
    """A ``vllm bench serve``-style block on stdout."""
    print(f"{'=' * 20} {title or 'Serving Benchmark Result'} {'=' * 20}")
    rows = [("Successful requests", run["completed"]), ("Failed requests", run["failed"]),
            ("Benchmark duration (s)", run["duration_s"]),
            ("Request throughput (req/s)", run["request_throughput"]),
            ("Output token throughput (tok/s)", run["output_token_throughput"])]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{stat.upper()} {key[:-3].upper()} (ms)", run[key][stat]))
    rows.append(("SLO attainment", _pct(run.get("slo_attainment"))))
    if run.get("goodput_rps") is not None:
        rows.append(("Goodput (req/s at >= 90% attainment)", run["goodput_rps"]))
    for label, value in rows:
        print(f"{label:<44}{_fmt(value) if not isinstance(value, int) else value:>12}")


def _measurements(run: dict) -> list[tuple[str, dict]]:
    """(label, summary) of the run and of every goodput probe in it."""
    probes = (run.get("goodput") or {}).get("points") or []
    return [("", run)] + [(f" @ {p['rate']:g} req/s", p["summary"]) for p in probes]


def failure_lines(result: dict) -> list[str]:
    """What went wrong, one block per run that lost requests: how many of how many, then its
    first distinct errors. Empty when every request of every run succeeded."""
    lines = []
    for run in runs_of(result):
        name = f"{run.get('name', 'run')} / {workload_label(run)}"
        if "error" in run:
            lines.append(f"{name}: not run: {run['error']}")
            continue
        for suffix, summary in _measurements(run):
            if summary.get("failed"):
                lines.append(f"{name}{suffix}: {summary['failed']} of "
                             f"{summary['num_requests']} requests failed")
                lines += [f"  {e['count']} x {e['error']}" for e in summary.get("errors", [])]
    return lines


def approximate_count_lines(result: dict) -> list[str]:
    """A warning per run whose token counts were guessed from text chunks."""
    return [f"{run.get('name', 'run')} / {workload_label(run)}: the server's stream states no "
            "token counts; TTFT and ITL assume one token per text chunk (approximate)"
            for run in measured_runs(result)
            if not run.get("token_counts", {}).get("exact", True)]
