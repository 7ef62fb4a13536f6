"""``benchmarks/cpu_heap_faults.py``: each setting reaches its server, and a small run
writes both settings' figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import cpu_heap_faults  # noqa: E402


def _environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_each_setting_reaches_its_server_and_nothing_of_the_other(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "7")  # the caller's own: put back after
    for setting, wanted in cpu_heap_faults.SETTINGS.items():
        server = cpu_heap_faults.started(setting)
        try:
            seen = _environment(server.process.pid)
        finally:
            server.stop()
        assert {name: seen.get(name) for name in cpu_heap_faults.KEEP_HEAP_ENV} == {
            name: wanted.get(name) for name in cpu_heap_faults.KEEP_HEAP_ENV}
    assert cpu_heap_faults.os.environ["MALLOC_TRIM_THRESHOLD_"] == "7"


def test_a_small_run_writes_both_settings_figures(tmp_path):
    out = tmp_path / "faults.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_heap_faults.py"),
                    "--rounds", "1", "--answers", "1", "--tokens", "12", "--contexts", "64",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.read_text())
    assert result["kind"] == "measurement"
    for setting in ("glibc_defaults", "heap_kept"):
        figures = result["median_over_rounds"][setting]["64"]
        assert figures["decode_faults_per_token"] >= 0 and figures["prompt_faults"] >= 0
        assert 0 < figures["ttft_ms_p50"] and 0 < figures["step_ms_p50"]
