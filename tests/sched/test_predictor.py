from __future__ import annotations

import pytest

from pdserve.sched.predictor import (
    LatencyPredictor,
    ProfileRecord,
    predictor_path,
    train_test_split,
)
from pdserve.sched.roofline import RooflinePredictor, synthetic_profile

PROFILED_SMS = [16, 24, 32, 48, 64, 96, 132]
KEY = dict(gpu_name="NVIDIA H200", model_name="codellama-34b", num_layers=48)


@pytest.fixture(scope="module")
def truth() -> RooflinePredictor:
    return RooflinePredictor()


@pytest.fixture(scope="module")
def split(truth):
    rows = synthetic_profile(truth, PROFILED_SMS, noise=0.03, seed=1)
    return train_test_split(rows, test_fraction=0.2, seed=0)


@pytest.fixture(scope="module")
def fitted(split) -> LatencyPredictor:
    return LatencyPredictor.fit(split[0], **KEY)


def test_fit_recovers_the_physics_on_held_out_rows(fitted, split):
    report = fitted.evaluate(split[1])
    assert report["n"] == len(split[1]) > 100
    assert report["median_rel_err"] <= 0.05
    assert report["p95_rel_err"] <= 0.15


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("co_running", [False, True])
def test_each_phase_and_mode_is_accurate(fitted, split, phase, co_running):
    rows = [r for r in split[1] if r["phase"] == phase and r["co_running"] == co_running]
    report = fitted.evaluate(rows)
    assert report["median_rel_err"] <= 0.05 and report["p95_rel_err"] <= 0.15


def test_co_running_is_slower_and_asymmetric(fitted):
    alone = fitted.predict("decode", 16, 16 * 1024, 16, 32)
    together = fitted.predict("decode", 16, 16 * 1024, 16, 32, co_running=True)
    assert together > 1.2 * alone
    # Whole GPU: nothing runs beside it, so co-running is meaningless there.
    assert fitted.predict("decode", 16, 16384, 16, 132, True) == fitted.predict(
        "decode", 16, 16384, 16, 132)


def test_unprofiled_sm_counts_interpolate(fitted, truth):
    rows = synthetic_profile(truth, [40, 80], noise=0.0, seed=2)
    report = fitted.evaluate(rows)
    assert report["median_rel_err"] <= 0.05 and report["p95_rel_err"] <= 0.15


def test_layer_pieces_scale_with_the_share_of_layers(fitted, truth):
    for layers in (2, 6, 24):
        want = truth.predict("prefill", 4096, 0, 1, 96, True, layers)
        got = fitted.predict("prefill", 4096, 0, 1, 96, True, num_layers=layers)
        assert got == pytest.approx(want, rel=0.08)


def test_mixed_steps_compose_prefill_and_decode_attention(fitted, truth):
    for chunk, batch, context in ((256, 16, 1024), (1024, 64, 4096), (2048, 8, 16384)):
        want = truth.predict_mixed(chunk, 0, 1, batch, batch * context)
        got = fitted.predict_mixed(chunk, 0, 1, batch, batch * context)
        assert got == pytest.approx(want, rel=0.08)


def test_mixed_rows_calibrate_the_composition(split, truth):
    mixed = [dict(phase="mixed", num_tokens=c, context_tokens=0, batch_size=1, sms=132,
                  co_running=False, decode_batch=b, decode_context=b * 2048,
                  latency_ms=1.25 * truth.predict_mixed(c, 0, 1, b, b * 2048))
             for c in (256, 512, 1024, 2048) for b in (8, 32)]
    pred = LatencyPredictor.fit(split[0] + mixed, **KEY)
    assert pred.mixed_factor == pytest.approx(1.25, rel=0.05)
    assert pred.evaluate(mixed)["median_rel_err"] <= 0.05


def test_sparse_co_running_rows_fall_back_to_a_contention_factor(truth):
    rows = synthetic_profile(truth, [32, 132], noise=0.0, seed=3)
    alone = [r for r in rows if not r["co_running"]]
    few = [r for r in rows if r["co_running"] and r["phase"] == "decode"][:3]
    pred = LatencyPredictor.fit(alone + few, **KEY)
    want = truth.predict("decode", 32, 32 * 4096, 32, 32, True)
    assert pred.predict("decode", 32, 32 * 4096, 32, 32, True) == pytest.approx(want, rel=0.1)
    with pytest.raises(LookupError):  # no co-running prefill rows at all
        pred.predict("prefill", 1024, 0, 1, 32, co_running=True)


def test_save_and_load_round_trip(fitted, tmp_path):
    path = fitted.save(predictor_path(tmp_path, "NVIDIA H200", "codellama-34b"))
    assert path.name == "nvidia_h200__codellama-34b.json"
    loaded = LatencyPredictor.load(path, gpu_name="NVIDIA H200", model_name="codellama-34b")
    for args in (("decode", 64, 64 * 2048, 64, 40, True), ("prefill", 3000, 4096, 2, 92, True),
                 ("prefill", 512, 0, 1, 132, False)):
        assert loaded.predict(*args) == pytest.approx(fitted.predict(*args), rel=1e-12)
    with pytest.raises(ValueError, match="GPU"):
        LatencyPredictor.load(path, gpu_name="NVIDIA A100")


def test_rows_may_be_records_or_dicts(split):
    records = [ProfileRecord.of(r) for r in split[0]]
    assert records[0] == ProfileRecord.of(records[0])
    pred = LatencyPredictor.fit(records, **KEY)
    assert pred.evaluate(split[1][:50])["median_rel_err"] <= 0.05


def test_train_test_split_is_deterministic_and_disjoint():
    rows = list(range(100))
    train, test = train_test_split(rows, 0.25, seed=7)
    assert (len(train), len(test)) == (75, 25)
    assert sorted(train + test) == rows
    assert train_test_split(rows, 0.25, seed=7) == (train, test)


def test_unknown_phase_is_an_error(fitted):
    with pytest.raises(ValueError):
        fitted.predict("mixed", 1, 1, 1, 132)
