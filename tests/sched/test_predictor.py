from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.sched.mux_planner import MuxPlanner, MuxPlannerConfig, profile_groups
from pdserve.sched.predictor import (
    LatencyPredictor,
    ProfileRecord,
    UncoveredGroupsError,
    _nnls,
    predictor_path,
    require_coverage,
    served_predictor,
    stratified_split,
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


# ------------------------------------------------- rows measured on an H200

H200_ROWS = Path(__file__).parent.parent / "data" / "h200_codellama34b_profile_rows.json"


@pytest.fixture(scope="module")
def h200_runs() -> list[list[dict]]:
    return list(json.loads(H200_ROWS.read_text())["runs"].values())


def held_out_reports(rows: list[dict], seeds: range) -> list[dict]:
    reports = []
    for seed in seeds:
        train, test = stratified_split(rows, test_fraction=0.2, seed=seed)
        reports.append(LatencyPredictor.fit(train, **KEY).evaluate(test))
    return reports


def meets_targets(report: dict) -> bool:
    return report["median_rel_err"] <= 0.05 and report["p95_rel_err"] <= 0.15


def test_held_out_error_on_h200_rows_meets_the_targets(h200_runs):
    report = held_out_reports(h200_runs[0], range(1))[0]
    assert report["n"] >= 25
    assert meets_targets(report)


# Both runs miss seeds 2 and 4. Seed 2 holds out every prefix-free alone prefill point under
# 1024 tokens (equal-size groups shuffle alike), so the fit extrapolates 256-token pieces
# from 1024+ (P95 45% / 26%); seed 4's P95 is 15.7% / 19.6%. The prefill-feature change took
# run_slo60 from 7 to 8 seeds; the short pieces' own prefix pairs moved run_slo40 from 9 to
# 8 (every piece here is a multiple of 256 tokens, so no GEMM tile steps are fitted; with
# them forced, both reached 9 by putting the whole cost per token on the steps).
RUNS_AT_TARGET = [pytest.param(run, marks=pytest.mark.xfail(
    strict=True, reason="8 of 10 seeds: see the comment above"))
    for run in ("run_slo60", "run_slo40")]


@pytest.mark.parametrize("run", RUNS_AT_TARGET)
def test_held_out_error_meets_the_targets_for_nine_of_ten_splits(run):
    rows = json.loads(H200_ROWS.read_text())["runs"][run]
    reports = held_out_reports(rows, range(10))
    assert sum(meets_targets(r) for r in reports) >= 9
    assert max(r["median_rel_err"] for r in reports) <= 0.05


def test_a_fit_on_one_h200_profile_predicts_another_run(h200_runs):
    first, second = h200_runs
    for fit_on, check in ((first, second), (second, first)):
        rows = [r for r in check if r["phase"] != "mixed"]
        report = LatencyPredictor.fit(fit_on, **KEY).evaluate(rows)
        assert report["median_rel_err"] <= 0.05 and report["p95_rel_err"] <= 0.15


def test_every_profiled_group_keeps_training_rows(h200_runs):
    train, test = stratified_split(h200_runs[0], test_fraction=0.2, seed=0)
    group = lambda r: (r["phase"], r["sms"], r["co_running"])
    assert {group(r) for r in test} <= {group(r) for r in train}
    assert len(train) + len(test) == len(h200_runs[0])


def test_h200_fits_never_predict_negative_costs(h200_runs):
    pred = LatencyPredictor.fit(h200_runs[0], **KEY)
    assert all(c >= 0 for f in pred.to_json()["fits"] for c in f["coef"])
    for sms in (68, 100, 132):  # more tokens never take less time
        times = [pred.predict("prefill", t, 0, 1, sms, num_layers=6) for t in (64, 256, 1024)]
        assert 0 < times[0] <= times[1] <= times[2]


@pytest.mark.parametrize("seed", range(5))
def test_nnls_satisfies_the_optimality_conditions(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(12, 5)), rng.normal(size=12)
    x = _nnls(a, b)
    gradient = a.T @ (b - a @ x)  # KKT: x >= 0, gradient <= 0, x * gradient == 0
    assert (x >= 0).all()
    assert (gradient <= 1e-8).all()
    assert np.abs(x * gradient).max() <= 1e-8


def test_nnls_equals_least_squares_when_that_is_non_negative():
    rng = np.random.default_rng(7)
    a = rng.uniform(0.5, 1.5, size=(10, 3))
    b = a @ np.array([1.0, 2.0, 0.5])
    assert _nnls(a, b) == pytest.approx([1.0, 2.0, 0.5], rel=1e-9)


def test_an_older_format_is_refitted_from_its_rows(h200_runs, tmp_path):
    rows = h200_runs[0]
    fresh = LatencyPredictor.fit(rows, **KEY, total_sms=132)
    old = {**fresh.to_json(), "format": 1, "fits": [], "rows": rows}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = LatencyPredictor.load(path)
    assert loaded.predict("decode", 16, 16 * 8192, 16, 64, True) == pytest.approx(
        fresh.predict("decode", 16, 16 * 8192, 16, 64, True), rel=1e-12)
    path.write_text(json.dumps({**old, "rows": []}))
    with pytest.raises(ValueError, match="format"):  # nothing to refit from
        LatencyPredictor.load(path)


# ------------------------------------------ the predictor covers the planner's choices

ENGINE_DEFAULT_SPLITS = [(d, 132 - d) for d in (16, 24, 32, 48, 64)]  # mux_decode_sms
PROFILED_SPLITS = [(16, 116), (32, 100), (64, 68)]  # the committed rows' partitions


def groups_of(splits) -> list[tuple[str, int, bool]]:
    planner = MuxPlanner(RooflinePredictor(), splits, MuxPlannerConfig(itl_slo_ms=60.0))
    assert planner.profile_groups() == profile_groups(splits, 132)
    return profile_groups(splits, 132)


def test_the_profile_grid_lists_every_split_and_the_whole_gpu():
    assert groups_of([(24, 108)]) == [("decode", 24, True), ("decode", 132, False),
                                      ("prefill", 108, True), ("prefill", 132, False)]
    temporal_only = MuxPlanner(RooflinePredictor(), [(24, 108)], MuxPlannerConfig(
        itl_slo_ms=60.0, spatial=False))
    assert temporal_only.profile_groups() == [("decode", 132, False), ("prefill", 132, False)]


def test_a_profile_missing_a_planner_choice_is_refused_by_name(h200_runs):
    pred = LatencyPredictor.fit(h200_runs[0], **KEY)
    with pytest.raises(UncoveredGroupsError) as caught:
        require_coverage(pred, groups_of(ENGINE_DEFAULT_SPLITS))
    assert caught.value.missing == [("decode", 24, True), ("decode", 48, True),
                                    ("prefill", 84, True), ("prefill", 108, True)]
    assert "decode on 24 SMs co-running" in str(caught.value)
    assert "roofline fallback" in str(caught.value)


def test_a_profile_of_every_choice_is_used_as_it_is(h200_runs):
    pred = LatencyPredictor.fit(h200_runs[0], **KEY)
    assert require_coverage(pred, groups_of(PROFILED_SPLITS)) is pred
    roofline = RooflinePredictor()  # answers every group from first principles
    assert require_coverage(roofline, groups_of(ENGINE_DEFAULT_SPLITS)) is roofline


def test_the_roofline_answers_only_the_missing_groups_when_asked_to(h200_runs):
    pred, roofline = LatencyPredictor.fit(h200_runs[0], **KEY), RooflinePredictor()
    model = require_coverage(pred, groups_of(ENGINE_DEFAULT_SPLITS), fallback=roofline)
    args = ("decode", 2, 2 * 16000, 2)
    assert model.predict(*args, 24, True) == roofline.predict(*args, 24, True)
    assert model.predict(*args, 32, True) == pred.predict(*args, 32, True)
    assert model.predict("prefill", 4096, 0, 1, 108, True, 3) == roofline.predict(
        "prefill", 4096, 0, 1, 108, True, 3)
    assert model.predict_mixed(512, 0, 1, 8, 8 * 4096) == pred.predict_mixed(
        512, 0, 1, 8, 8 * 4096)


def test_fitted_groups_are_the_measured_ones(h200_runs):
    pred = LatencyPredictor.fit(h200_runs[0], **KEY)
    groups = pred.fitted_groups()
    # Co-running prefill has too few rows for its own fit: alone x a factor measured there.
    assert {("prefill", 100, True), ("prefill", 132, False), ("decode", 132, False)} <= groups
    assert not any(sms == 24 for _, sms, _ in groups)


# The long-context profiles (pieces over cached prefixes up to 16K tokens, mixed steps) on
# their committed rows. The GEMM tile count (in groups whose pieces can tell it apart) and
# the short pieces' own prefix pairs took 7c34071 and 1fcf915 from 7 to 8 of 10, 20d5278 and
# a11edb9 from 7 to 9 and 06d5640 (co-running decode at every batch and split) from 8 to 10
# (fixed: a held-out
# 2048-token piece over a 12K prefix priced +20-25% from the short pieces' cost per pair,
# and 128-token rows fitted across the step to 192). What misses now is one held-out row
# a shape of its own in a region that is not smooth, or a launch that varies between runs:
# 3edb18c (the goodput probes' profile at e1f3fe3, no prefill row under 256 tokens): 6 of
# 10, 256-token pieces whole-model or over 6 layers held out with nothing shorter (-23% to
# +22%), 256 over 8-16K prefixes on 132 SMs +28%. 20d5278 (9 of 10) missed on the only
# prefix-free 128-token row and 256 tokens over 6 layers, whose time differs between
# profiles (3.4-6.1 ms on 132 SMs). 7c34071: 8 of 10, 256
# over 6 layers (+39%) and the only 512-token piece over a 16K prefix (+19-22%: its cost per
# pair lies between the short pieces' and the long ones'). 1fcf915: 8 of 10, the 128-token
# whole-model rows held out (68 SMs take 41 ms, no step from 192 there; 84 SMs 25 ms,
# predicted +47%) with only a 128-token piece over an 8K prefix left to place the step.
# Mixed steps of 128 prompt tokens beside 32 decodes are predicted 18-27% slow (seed 5 of
# three profiles, seed 9 of a11edb9; one fitted factor for all mixed rows).
LONG_CONTEXT_PROFILES = [
    pytest.param(rev, marks=pytest.mark.xfail(strict=True, reason=f"{seeds} of 10 seeds: "
                                              "see the comment above"))
    for rev, seeds in (("3edb18c", 6), ("7c34071", 8), ("1fcf915", 8))
] + ["20d5278", "a11edb9", "06d5640"]


@pytest.mark.parametrize("revision", LONG_CONTEXT_PROFILES)
def test_the_long_context_profile_meets_the_targets_for_nine_of_ten_splits(revision):
    data = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                       / "loogle_h200" / f"{revision}_predictor.json").read_text())
    reports = held_out_reports(data["rows"], range(10))
    assert sum(meets_targets(r) for r in reports) >= 9


def test_the_five_split_profile_meets_the_targets_for_nine_of_ten_splits():
    """The profile the planner serves with (decode on 16, 24, 32, 48 or 64 SMs, every
    group it can pick, whole-GPU time slices included), measured on the H200 at 6f90be1."""
    data = json.loads((H200_ROWS.parent / "h200_codellama34b_profile_rows_6f90be1.json")
                      .read_text())
    reports = held_out_reports(data["rows"], range(10))
    assert all(r["n"] >= 40 for r in reports)
    assert sum(meets_targets(r) for r in reports) >= 9
    assert max(r["median_rel_err"] for r in reports) <= 0.05


def test_a_saved_format_3_fit_is_served_as_saved_and_a_mismatched_one_refused(tmp_path):
    """Replays plan with the fit a recorded engine loaded: a format-3 prefill fit keeps its
    predictions (its one prefix-pair coefficient on both halves, no tile steps); a fit
    whose coefficients do not map is refused, not read into the wrong features."""
    path = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "loogle_h200"
            / "d698fcb_predictor.json")
    data = json.loads(path.read_text())
    assert data["format"] == 3
    served = served_predictor(path)
    fit = next(f for f in data["fits"] if f["phase"] == "prefill" and f["sms"] == 132
               and not f["co_running"])
    c = fit["coef"]  # launch, layers, tokens, bend, prefix pairs, causal pairs (format 3)
    tokens, prefix = 2048, 8192
    want = (c[0] + c[1] + c[2] * tokens * 1e-3 + c[3] * max(0, tokens - fit["knee"]) * 1e-3
            + c[4] * tokens * prefix * 1e-6 + c[5] * tokens * tokens / 2 * 1e-6)
    assert served.predict("prefill", tokens, prefix, 1, 132) == pytest.approx(want, rel=1e-9)
    fit["coef"] = c[:5]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="does not map"):
        served_predictor(broken)
