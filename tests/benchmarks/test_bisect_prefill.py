"""benchmarks/bisect_prefill.py on the CPU: revision folders, one process each, one JSON."""

from __future__ import annotations

import importlib.util
import itertools
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bisect = _load("bisect_prefill")


def _revision_folder(path: Path, revision: str | None) -> Path:
    """A folder as `git archive REV pdserve | tar -x` makes it: this checkout's package."""
    shutil.copytree(ROOT / "pdserve", path / "pdserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if revision is not None:
        (path / "REVISION").write_text(revision + "\n")
    return path


CPU_FLAGS = ["--device", "cpu", "--model", "tiny", "--tokens", "24", "--runs", "2",
             "--max-model-len", "129"]


def test_each_revision_runs_in_its_own_process_from_its_own_folder(tmp_path, monkeypatch):
    tree = _revision_folder(tmp_path / "rev", "0123abc")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this checkout's copy on the path too
    out = tmp_path / "bisect.json"
    assert bisect.main([str(tree), *CPU_FLAGS, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python ") and report["tokens"] == 24
    [result] = report["revisions"]
    assert result["revision"] == "0123abc"
    # The child imported the folder's copy, not this checkout's.
    assert Path(result["pdserve"]).resolve().is_relative_to(tree.resolve())
    assert len(result["runs"]) == 2 and all(run["seconds"] > 0 for run in result["runs"])
    assert result["device"]["gpu"] == {"unavailable": "device cpu"}
    [row] = report["summary"]
    seconds = sorted(run["seconds"] for run in result["runs"])
    assert row["min_s"] == seconds[0] and row["max_s"] == seconds[1]
    assert row["tokens_per_s"] == pytest.approx(24 / row["median_s"])


def test_a_revision_that_fails_is_recorded_and_fails_the_call(tmp_path):
    broken = _revision_folder(tmp_path / "broken", None)
    (broken / "pdserve" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    out = tmp_path / "bisect.json"
    assert bisect.main([str(broken), *CPU_FLAGS, "--out", str(out)]) == 1
    [result] = json.loads(out.read_text())["revisions"]
    assert result["revision"] == "broken"  # no REVISION file: the folder's name
    assert result["error"] == "exit status 1" and "broken on purpose" in result["stderr_tail"]


def test_a_folder_without_the_package_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="no pdserve package"):
        bisect.main([str(tmp_path), *CPU_FLAGS, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_a_child_that_imported_another_copy_stops(tmp_path):
    with pytest.raises(SystemExit, match="shadows the revision folder"):
        bisect.check_package_origin(str(ROOT / "pdserve" / "__init__.py"), tmp_path)
    bisect.check_package_origin(str(tmp_path / "pdserve" / "__init__.py"), tmp_path)


def test_prompt_longer_than_the_engine_allows_is_a_usage_error():
    with pytest.raises(SystemExit):
        bisect.parse_args(["some/tree", "--tokens", "8192", "--max-model-len", "8192"])


class _FakeNvml:
    """Answers each query with its own column of ``readings`` (clock, temperature, milliwatts,
    reasons), one row per read, whatever order the sampler asks in."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 0, 0

    def __init__(self, readings):
        self.columns = [iter(column) for column in zip(*readings, strict=True)]

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return next(self.columns[0])

    def nvmlDeviceGetTemperature(self, handle, kind):
        return next(self.columns[1])

    def nvmlDeviceGetPowerUsage(self, handle):
        return next(self.columns[2])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return next(self.columns[3])


def test_clock_samples_summarise_to_means_extremes_and_every_throttle_reason():
    nvml = _FakeNvml([(1980, 50, 650_000, 0), (1700, 61, 700_000, 4), (1800, 58, 690_000, 8)])
    sampler = bisect.NvmlSampler(nvml, handle=None)
    samples = [sampler.read() for _ in range(3)]
    summary = bisect.summarise_samples(samples)
    assert summary["sm_clock_mhz_mean"] == pytest.approx((1980 + 1700 + 1800) / 3)
    assert summary["sm_clock_mhz_min"] == 1700 and summary["temperature_c_max"] == 61
    assert summary["power_w_mean"] == pytest.approx(680.0)
    assert summary["clocks_event_reasons_seen"] == 4 | 8
    assert "not_reported" not in summary
    assert bisect.summarise_samples([]) == {"unavailable": "no NVML sample taken"}


def test_a_quantity_the_gpu_does_not_report_is_named_not_guessed():
    class NoPower(_FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    sampler = bisect.NvmlSampler(NoPower([(1900, 45, 0, 1), (1950, 47, 0, 0)]), handle=None)
    summary = bisect.summarise_samples([sampler.read(), sampler.read()])
    assert summary["not_reported"] == ["power"] and "power_w_mean" not in summary
    assert summary["sm_clock_mhz_mean"] == 1925 and summary["clocks_event_reasons_seen"] == 1


def test_the_sampler_reads_on_its_thread_until_stopped():
    sampler = bisect.NvmlSampler(_FakeNvml(itertools.repeat((1500, 40, 300_000, 0), 10_000)),
                                 handle=None, interval_s=0.001)
    sampler.start()
    summary = sampler.stop()
    assert summary["samples"] >= 1 and summary["sm_clock_mhz_mean"] == 1500


def test_prefill_flops_count_as_bench_engine_counts_them():
    from pdserve.config import EngineConfig
    from pdserve.engine.core import EngineCore

    bench_engine = _load("bench_engine")
    engine = EngineCore(EngineConfig.from_flat(model="tiny", device="cpu", dtype="float32",
                                               load_format="dummy"))
    model = engine.runner.model
    for length in (1, 300):
        assert bisect.prefill_flops(model, length) == bench_engine.prefill_flops(engine, length)


class _OneStepEngine:
    """Each added prompt takes one step; ``max_model_len`` as bench_engine asks for it."""

    max_model_len = 32769

    def __init__(self):
        self.pending, self.prompts = 0, []

    def add_request(self, request_id, prompt, params):
        self.pending += 1
        self.prompts.append(prompt)

    def has_work(self):
        return self.pending > 0

    def step(self):
        self.pending -= 1


class _RecordingSampler:
    def __init__(self):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")
        return {"sm_clock_mhz_mean": 1755.0}


def test_bench_engine_reads_the_clocks_over_the_timed_prefill_only(monkeypatch):
    bench_engine = _load("bench_engine")
    monkeypatch.setattr(bench_engine.torch.cuda, "synchronize", lambda: None)
    engine, sampler = _OneStepEngine(), _RecordingSampler()
    row = bench_engine.time_prefill(engine, 16, sampler)
    assert sampler.calls == ["start", "stop"]  # the warm-up run is not sampled
    assert row["gpu"] == {"sm_clock_mhz_mean": 1755.0} and row["tokens_per_s"] > 0
    assert engine.prompts[1] == [t + 1 for t in engine.prompts[0]]  # no prefix-cache hit
    assert "gpu" not in bench_engine.time_prefill(_OneStepEngine(), 16)


def test_bench_engine_pairs_each_decode_point_of_two_blas_libraries():
    bench_engine = _load("bench_engine")

    def result(library: str, step_ms: float) -> dict:
        rows = [{"batch": 1, "context": 1024, "overlap": True, "blas_library": library,
                 "step_ms": step_ms, "fraction_of_roofline": 15.0 / step_ms},
                {"batch": 256, "context": 1024, "overlap": True, "blas_library": library,
                 "skipped": "KV pool too small for this batch and context"}]
        return {"model": "codellama-34b", "decode": rows}

    speedups = bench_engine.blas_library_speedups([result("cublas", 18.0),
                                                   result("cublaslt", 17.5)])
    assert speedups == [{"blas_library_speedup": pytest.approx(18.0 / 17.5),
                         "model": "codellama-34b", "batch": 1, "context": 1024,
                         "overlap": True, "step_ms_cublas": 18.0, "step_ms_cublaslt": 17.5,
                         "fraction_of_roofline_cublaslt": pytest.approx(15.0 / 17.5)}]
