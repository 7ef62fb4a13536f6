"""Latency predictor: (phase, tokens, context, batch, SMs, co-running) -> milliseconds.

Fitted by least squares from profile rows the engine records, one linear model per
(phase, SM count, co-running) on features that follow the physics:

- GEMMs: flat while reading the weights dominates, linear in tokens past the ridge
  point. A hinge ``max(0, tokens - knee)`` models that bend; the knee is searched
  per group, because it moves with the SM count (bandwidth and FLOP rate scale apart).
- GEMM tiles: a GEMM computes whole tiles of 128 rows, so every 128 tokens started add
  a step on top of the linear terms (on 84-116 SMs of the H200, 128 -> 192 prompt tokens
  took a layer from 0.52 to 0.80 ms, while 192 -> 256 added little). Only pieces that end
  inside a tile tell the steps from the cost per token; a group without one fits no steps.
- Attention: decode reads the KV of every context token (linear in the context sum).
  Prefill computes query-key pairs, ``tokens * prefix / batch`` against the prefix and
  ``tokens**2 / 2 / batch`` among the new tokens (exact for equal requests), with a
  coefficient each: on the H200 the prefix part (another kernel path, KV read from the
  paged cache) cost more per pair than the causal part. The prefix pairs of a piece's
  first ``FULL_PREFIX_WAVE`` tokens have a coefficient of their own: a short piece's
  query tiles times heads do not fill the SMs, so a pair costs more there (on a
  partition, ~2x per pair for 256 tokens over a 16K prefix than for 2048 over 12K) and
  one coefficient fitted mostly on short pieces overpriced long ones by 20-25%.
  Reading the prefix KV is no feature of its own: it is negligible beside the weights,
  and a free linear term for it let a fit charge a 256-token piece the whole cost of a
  1024-token piece's prefix.
- Prefill pieces run ``num_layers`` of the model: every per-layer cost scales with the
  share of layers run, one launch overhead does not. There is no per-request term: the
  profile times one request per piece, so such a term could not be fitted apart from the
  per-layer constant and would multiply it by the batch size in planning.

Rows are weighted by 1 / latency, so the fit minimises relative error, which is what
the planner's SLO margins are in. Co-running groups are fitted on their own rows
(interference is not symmetric and depends on the split); a co-running
group with too few rows falls back to the alone model times a contention factor from
whatever co-running rows exist. SM counts between profiled ones interpolate linearly in
1 / SMs (time ~ work / rate); outside the profiled range the nearest count is used.

Saved as JSON keyed by (GPU name, model name); loading a file for another key fails.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

# 2: decode fits lost their token feature; 3: prefill pairs split in two; 4: GEMM tiles and
# the prefix pairs of a piece's first full wave
FORMAT_VERSION = 4
PHASES = ("decode", "prefill")
KNEES = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1024)
_TOKENS = 1e-3  # features in thousands of tokens keep the normal equations well scaled
_PAIRS = 1e-6
GEMM_TILE_ROWS = 128
# Query tokens of a piece past which its prefix attention fills the GPU. Where that is
# depends on the kernel's tiles and the model's heads; the committed H200 profiles fit alike
# for any split from 512 to 1024 tokens (256 or less left the pairs of the first tokens to
# a held-out row or two), so the fit does not search it.
FULL_PREFIX_WAVE = 512
# Predictions remembered per predictor (about 200 bytes each). The planner asks again and
# again for the same shapes while it searches chunk sizes and layer counts (a replay asked
# ~2.2 M times for ~52 K distinct shapes); past this many the memo starts over.
MEMO_ENTRIES = 1 << 17

ProfileGroup = tuple[str, int, bool]  # (phase, SMs, co-running): one fitted model each


@dataclass(frozen=True)
class ProfileRecord:
    """One timed launch, as the engine's profiler records it."""

    phase: str  # decode | prefill | mixed (a whole-GPU step carrying both)
    num_tokens: int  # tokens computed: one per request for decode, new tokens for prefill
    context_tokens: int  # decode: sum of the requests' contexts; prefill: sum of prefixes
    batch_size: int
    sms: int  # SMs the phase ran on
    co_running: bool  # the other phase ran at the same time on the other SMs
    latency_ms: float
    num_layers: int | None = None  # prefill piece: layers run (None: all)
    decode_batch: int = 0  # mixed steps only
    decode_context: int = 0  # mixed steps only

    @classmethod
    def of(cls, row: ProfileRecord | Mapping) -> ProfileRecord:
        if isinstance(row, ProfileRecord):
            return row
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})


@dataclass(frozen=True)
class _Fit:
    coef: tuple[float, ...]
    knee: float

    def predict(self, features: Sequence[float]) -> float:
        # Plain Python: the planner asks dozens of times per step; numpy's call overhead
        # costs more than these six multiplications.
        return sum(c * x for c, x in zip(self.coef, features, strict=True))


def _features(phase: str, tokens: float, context: float, batch: float, layer_share: float,
              knee: float) -> tuple[float, ...]:
    t, b = tokens * _TOKENS, max(batch, 1.0)
    bend = max(0.0, tokens - knee) * _TOKENS
    if phase == "decode":  # one token per request: tokens and batch are the same feature
        return (1.0, bend, context * _TOKENS, b)
    prefix_per_token = context / b * _PAIRS
    short_prefix_pairs = min(tokens, FULL_PREFIX_WAVE) * prefix_per_token
    long_prefix_pairs = max(0.0, tokens - FULL_PREFIX_WAVE) * prefix_per_token
    causal_pairs = tokens * tokens / 2 / b * _PAIRS
    tiles = math.ceil(tokens / GEMM_TILE_ROWS)
    s = layer_share
    return (1.0, s, s * t, s * bend, s * short_prefix_pairs, s * causal_pairs,
            s * long_prefix_pairs, s * tiles)


_TILE_FEATURE = 7  # index of the tile count among the prefill features


def _n_features(phase: str) -> int:
    return 4 if phase == "decode" else 8


def _fit_group(phase: str, rows: Sequence[ProfileRecord], num_layers: int) -> _Fit:
    target = np.array([r.latency_ms for r in rows])
    best: tuple[float, _Fit] | None = None
    tiles_seen = phase == "prefill" and _tiles_separable(rows)
    for knee in KNEES:
        x = np.array([_row_features(r, num_layers, knee) for r in rows])
        if phase == "prefill" and not tiles_seen:
            x[:, _TILE_FEATURE] = 0.0
        weighted = x / target[:, None]  # relative error: (x @ c - y) / y
        coef = _nnls(weighted, np.ones(len(rows)))
        err = float(np.sum((weighted @ coef - 1.0) ** 2))
        if best is None or err < best[0]:
            best = (err, _Fit(tuple(float(c) for c in coef), float(knee)))
    return best[1]


def _tiles_separable(rows: Sequence[ProfileRecord]) -> bool:
    """Whether the rows can tell the GEMM tile steps from the cost per token: only a piece
    that ends inside a tile can (where every piece is a whole number of tiles, the tile
    count is the token count over 128, and a fit free to choose put the whole slope on the
    steps: the d698fcb profile, all pieces multiples of 256 tokens, then priced mixed steps
    by whole tiles, 6.7% median error on its mixed rows against 2.9%)."""
    return any(r.num_tokens % GEMM_TILE_ROWS for r in rows)


def _nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (Lawson-Hanson active set).

    Every feature is a cost (launch overhead, bytes read, FLOPs), so no coefficient may be
    negative: a free least-squares fit on a dozen rows trades a negative slope against a
    positive one and then predicts nonsense (even negative times) a little outside them.
    """
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if free.all() or gradient[~free].max(initial=-np.inf) <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if z[free].min() > 0:
                x = z
                break
            # Step from x towards z until the first free coefficient reaches zero.
            falling = free & (z <= 0)
            alpha = np.min(x[falling] / (x[falling] - z[falling]))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x


def _row_features(r: ProfileRecord, num_layers: int, knee: float) -> tuple[float, ...]:
    share = (r.num_layers or num_layers) / num_layers
    return _features(r.phase, r.num_tokens, r.context_tokens, r.batch_size, share, knee)


class LatencyPredictor:
    """Fitted latency model of one model on one GPU. Build with ``fit`` or ``load``."""

    def __init__(self, gpu_name: str, model_name: str, num_layers: int, total_sms: int,
                 fits: dict[tuple[str, int, bool], _Fit] | None = None,
                 contention: dict[tuple[str, int], float] | None = None,
                 mixed_factor: float = 1.0):
        self.gpu_name = gpu_name
        self.model_name = model_name
        self.num_layers = num_layers
        self.total_sms = total_sms
        self._fits = dict(fits or {})
        self._contention = dict(contention or {})
        self.mixed_factor = mixed_factor
        self._known = self._index()
        self._memo: dict[tuple, float] = {}  # predict's answers by its arguments

    # ------------------------------------------------------------------ fitting

    @classmethod
    def fit(cls, rows: Iterable[ProfileRecord | Mapping], *, gpu_name: str, model_name: str,
            num_layers: int, total_sms: int | None = None) -> LatencyPredictor:
        records = [ProfileRecord.of(r) for r in rows]
        total = total_sms or max(r.sms for r in records)
        groups: dict[tuple[str, int, bool], list[ProfileRecord]] = defaultdict(list)
        for r in records:
            if r.phase in PHASES:
                groups[(r.phase, r.sms, bool(r.co_running and r.sms < total))].append(r)
        fits = {key: _fit_group(key[0], rows_, num_layers) for key, rows_ in groups.items()
                if len(rows_) >= _n_features(key[0]) + 2}
        pred = cls(gpu_name, model_name, num_layers, total, fits)
        pred._contention = pred._fit_contention(groups)
        pred._known = pred._index()
        mixed = [r for r in records if r.phase == "mixed"]
        if mixed:
            pred.mixed_factor = 1.0
            pred.mixed_factor = _geo_mean([r.latency_ms / pred._mixed_row(r) for r in mixed])
        return pred

    def _fit_contention(self, groups: Mapping[tuple[str, int, bool], list[ProfileRecord]]
                        ) -> dict[tuple[str, int], float]:
        """Co-running slowdown per (phase, SMs): observed co-running over predicted alone."""
        factors = {}
        for (phase, sms, co), rows in groups.items():
            if co and (phase, sms, False) in self._fits:
                alone = self._fits[(phase, sms, False)]
                ratios = [r.latency_ms / alone.predict(_row_features(r, self.num_layers,
                                                                     alone.knee))
                          for r in rows]
                factors[(phase, sms)] = _geo_mean(ratios)
        return factors

    # --------------------------------------------------------------- predicting

    def predict(self, phase: str, num_tokens: int, context_tokens: int, batch_size: int,
                sms: int, co_running: bool = False, num_layers: int | None = None) -> float:
        """Milliseconds for one decode step or one prefill piece of ``num_layers`` layers."""
        key = (phase, num_tokens, context_tokens, batch_size, sms, co_running, num_layers)
        ms = self._memo.get(key)
        if ms is None:  # the fits never change once built, so neither does the answer
            ms = self._computed(*key)
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = ms
        return ms

    def _computed(self, phase: str, num_tokens: int, context_tokens: int, batch_size: int,
                  sms: int, co_running: bool, num_layers: int | None) -> float:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
        co = bool(co_running and sms < self.total_sms)
        share = (num_layers or self.num_layers) / self.num_layers
        known = self.profiled_sms(phase, co)
        if not known:
            raise LookupError(f"no profile for {phase} (co_running={co})")
        at = lambda s: self._predict_at(phase, num_tokens, context_tokens, batch_size, share,
                                        s, co)
        i = bisect.bisect_left(known, sms)
        if i < len(known) and known[i] == sms:
            return at(sms)
        if i == 0 or i == len(known):
            return at(known[min(i, len(known) - 1)])
        lo, hi = known[i - 1], known[i]
        w = (1 / sms - 1 / hi) / (1 / lo - 1 / hi)
        return w * at(lo) + (1 - w) * at(hi)

    def predict_mixed(self, prefill_tokens: int, prefill_context: int, prefill_batch: int,
                      decode_batch: int, decode_context: int, sms: int | None = None) -> float:
        """A whole-GPU step carrying a prefill chunk and the decode batch together.

        Decode tokens ride in prefill's GEMMs (one weight read for both), so the step is a
        prefill of ``prefill_tokens + decode_batch`` tokens plus decode's attention (the
        context-dependent part of a decode step), scaled by a factor fitted on mixed rows.
        """
        sms = sms or self.total_sms
        if prefill_tokens <= 0:
            return self.predict("decode", decode_batch, decode_context, decode_batch, sms)
        gemms = self.predict("prefill", prefill_tokens + decode_batch, prefill_context,
                             max(prefill_batch, 1), sms)
        attention = (self.predict("decode", decode_batch, decode_context, decode_batch, sms)
                     - self.predict("decode", decode_batch, 0, decode_batch, sms))
        return self.mixed_factor * (gemms + max(attention, 0.0))

    def fitted_groups(self) -> set[ProfileGroup]:
        """Groups answered from rows measured on exactly that (phase, SMs, co-running): their
        own fit, or the alone fit times a contention factor measured at that SM count.
        Anything else is interpolated or borrowed from another SM count."""
        measured_contention = {(p, s, True) for (p, s) in self._contention
                               if (p, s, False) in self._fits}
        return set(self._fits) | measured_contention

    def profiled_sms(self, phase: str, co_running: bool) -> list[int]:
        """SM counts this predictor can answer for directly (others interpolate)."""
        return self._known.get((phase, co_running), [])

    def _index(self) -> dict[tuple[str, bool], list[int]]:
        return {(phase, co): self._answerable(phase, co) for phase in PHASES
                for co in (False, True)}

    def _answerable(self, phase: str, co_running: bool) -> list[int]:
        own = {s for (p, s, co) in self._fits if p == phase and co == co_running}
        if co_running:
            own |= {s for (p, s, co) in self._fits if p == phase and not co
                    and s < self.total_sms and self._contention_at(phase, s) is not None}
        return sorted(own)

    def _predict_at(self, phase: str, tokens: int, context: int, batch: int, share: float,
                    sms: int, co: bool) -> float:
        fit = self._fits.get((phase, sms, co))
        factor = 1.0
        if fit is None:  # co-running without its own fit: alone x contention
            fit, factor = self._fits[(phase, sms, False)], self._contention_at(phase, sms)
        x = _features(phase, tokens, context, batch, share, fit.knee)
        return factor * max(fit.predict(x), 1e-3)

    def _contention_at(self, phase: str, sms: int) -> float | None:
        if (phase, sms) in self._contention:
            return self._contention[(phase, sms)]
        near = sorted((abs(s - sms), f) for (p, s), f in self._contention.items() if p == phase)
        return near[0][1] if near else None

    def _mixed_row(self, r: ProfileRecord) -> float:
        return self.predict_mixed(r.num_tokens, r.context_tokens, r.batch_size,
                                  r.decode_batch, r.decode_context, r.sms)

    def predict_row(self, row: ProfileRecord | Mapping) -> float:
        r = ProfileRecord.of(row)
        if r.phase == "mixed":
            return self._mixed_row(r)
        return self.predict(r.phase, r.num_tokens, r.context_tokens, r.batch_size, r.sms,
                            r.co_running, r.num_layers)

    # --------------------------------------------------------------- evaluating

    def evaluate(self, rows: Iterable[ProfileRecord | Mapping]) -> dict[str, float]:
        """Relative error |predicted - measured| / measured over ``rows``."""
        records = [ProfileRecord.of(r) for r in rows]
        errs = np.array([abs(self.predict_row(r) - r.latency_ms) / r.latency_ms
                         for r in records])
        if errs.size == 0:
            return {"n": 0, "median_rel_err": math.nan, "p95_rel_err": math.nan,
                    "max_rel_err": math.nan}
        return {"n": int(errs.size), "median_rel_err": float(np.median(errs)),
                "p95_rel_err": float(np.percentile(errs, 95)), "max_rel_err": float(errs.max())}

    # ----------------------------------------------------------------- storing

    def to_json(self) -> dict:
        return {
            "format": FORMAT_VERSION, "gpu": self.gpu_name, "model": self.model_name,
            "num_layers": self.num_layers, "total_sms": self.total_sms,
            "mixed_factor": self.mixed_factor,
            "fits": [{"phase": p, "sms": s, "co_running": co, **asdict(f)}
                     for (p, s, co), f in sorted(self._fits.items())],
            "contention": [{"phase": p, "sms": s, "factor": f}
                           for (p, s), f in sorted(self._contention.items())],
        }

    @classmethod
    def from_json(cls, data: Mapping) -> LatencyPredictor:
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"predictor format {data.get('format')}, expected {FORMAT_VERSION}")
        fits = {(f["phase"], f["sms"], f["co_running"]): _Fit(tuple(f["coef"]), f["knee"])
                for f in data["fits"]}
        contention = {(c["phase"], c["sms"]): c["factor"] for c in data["contention"]}
        return cls(data["gpu"], data["model"], data["num_layers"], data["total_sms"], fits,
                   contention, data.get("mixed_factor", 1.0))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, gpu_name: str | None = None,
             model_name: str | None = None) -> LatencyPredictor:
        """Loads a saved predictor; with names given, refuses one fitted elsewhere.

        A file of an older format is refitted from the profile rows it carries (the
        profiler saves them), so a new fitting method needs no new GPU profile."""
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT_VERSION and data.get("rows"):
            pred = cls.fit(data["rows"], gpu_name=data["gpu"], model_name=data["model"],
                           num_layers=data["num_layers"], total_sms=data["total_sms"])
        else:
            pred = cls.from_json(data)
        for want, got, what in ((gpu_name, pred.gpu_name, "GPU"),
                                (model_name, pred.model_name, "model")):
            if want is not None and want != got:
                raise ValueError(f"{path}: fitted for {what} {got!r}, not {want!r}")
        return pred


def served_predictor(path: str | Path) -> LatencyPredictor:
    """The fit saved in a predictor file, as an engine that loaded the file planned with
    it: for replays of recorded runs, whose corrections are measured over that fit, where
    ``LatencyPredictor.load`` refits a file of an older format from its rows (the 8ccd9ac
    validation replay came 39% under its measured TTFT P50 on a refit, 9.5% on the saved
    fit). A format-3 fit is this format's with its one prefix-pair coefficient on both
    halves of the pairs and no GEMM tile steps: the same predictions."""
    data = json.loads(Path(path).read_text())
    if data.get("format") == 3:
        data = {**data, "format": FORMAT_VERSION,
                "fits": [_format_3_fit(f) for f in data["fits"]]}
    return LatencyPredictor.from_json(data)


_PREFIX_PAIRS_FEATURE = 4  # index of (the first tokens') prefix pairs among prefill features


def _format_3_fit(fit: dict) -> dict:
    if fit["phase"] != "prefill":
        return fit  # decode features did not change
    coef = [*fit["coef"], fit["coef"][_PREFIX_PAIRS_FEATURE], 0.0]
    if len(coef) != _n_features("prefill"):  # a later format must say how format 3 maps
        raise ValueError(f"format-3 prefill fit of {len(fit['coef'])} coefficients does not "
                         f"map to this format's {_n_features('prefill')}")
    return {**fit, "coef": coef}


class UncoveredGroupsError(LookupError):
    """The predictor was not fitted on some (phase, SMs, co-running) the planner can pick."""

    def __init__(self, missing: Iterable[ProfileGroup]):
        self.missing = sorted(missing)
        listed = ", ".join(f"{p} on {s} SMs{' co-running' if co else ''}"
                           for p, s, co in self.missing)
        super().__init__(
            f"the latency profile has no rows for {listed}; profile these groups "
            "(`pdserve profile` with these SM counts) or opt into the roofline fallback")


class GroupFallback:
    """A fitted predictor that answers the groups it lacks with another model (the roofline).

    Only built on request (``require_coverage(..., fallback=...)``): a guess for the
    missing groups is the user's explicit choice, never a silent one."""

    def __init__(self, fitted: LatencyPredictor, fallback, missing: Iterable[ProfileGroup]):
        self.fitted, self.fallback, self.missing = fitted, fallback, frozenset(missing)
        self.num_layers, self.total_sms = fitted.num_layers, fitted.total_sms

    def predict(self, phase: str, num_tokens: int, context_tokens: int, batch_size: int,
                sms: int, co_running: bool = False, num_layers: int | None = None) -> float:
        co = bool(co_running and sms < self.total_sms)
        model = self.fallback if (phase, sms, co) in self.missing else self.fitted
        return model.predict(phase, num_tokens, context_tokens, batch_size, sms, co,
                             num_layers)

    def predict_mixed(self, prefill_tokens: int, prefill_context: int, prefill_batch: int,
                      decode_batch: int, decode_context: int, sms: int | None = None
                      ) -> float:
        whole = {(phase, sms or self.total_sms, False) for phase in PHASES}
        model = self.fallback if whole & self.missing else self.fitted
        return model.predict_mixed(prefill_tokens, prefill_context, prefill_batch,
                                   decode_batch, decode_context, sms)


def require_coverage(predictor, groups: Iterable[ProfileGroup], fallback=None):
    """``predictor`` if it was fitted on every group in ``groups`` (a planner's
    ``profile_groups()``); else ``UncoveredGroupsError``, or with ``fallback`` given, a
    ``GroupFallback`` that asks it for the missing groups. A model that is not fitted from
    rows (the roofline) answers every group and is returned as it is."""
    if not isinstance(predictor, LatencyPredictor):
        return predictor
    missing = set(groups) - predictor.fitted_groups()
    if not missing:
        return predictor
    if fallback is None:
        raise UncoveredGroupsError(missing)
    return GroupFallback(predictor, fallback, missing)


def predictor_path(directory: str | Path, gpu_name: str, model_name: str) -> Path:
    """Where the predictor of (GPU, model) lives under ``directory``."""
    slug = lambda s: re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_").lower()
    return Path(directory) / f"{slug(gpu_name)}__{slug(model_name)}.json"


def train_test_split(rows: Sequence, test_fraction: float = 0.2, seed: int = 0
                     ) -> tuple[list, list]:
    """Shuffled (train, test) lists for held-out evaluation."""
    order = list(rows)
    random.Random(seed).shuffle(order)
    cut = int(round(len(order) * (1 - test_fraction)))
    return order[:cut], order[cut:]


def stratified_split(rows: Sequence[ProfileRecord | Mapping], test_fraction: float = 0.2,
                     seed: int = 0) -> tuple[list, list]:
    """``train_test_split`` within each fitted group (phase, SMs, co-running).

    A profile holds about ten rows per group, a few more than a group's fit needs; a plain
    shuffle can leave a group too few training rows, and the held-out error then measures
    the fallback (another SM count's fit), not the predictor that gets saved.
    """
    groups: dict[tuple, list] = defaultdict(list)
    for row in rows:
        r = ProfileRecord.of(row)
        groups[(r.phase, r.sms, r.co_running)].append(row)
    train, test = [], []
    for key in sorted(groups):
        group_train, group_test = train_test_split(groups[key], test_fraction, seed)
        train += group_train
        test += group_test
    return train, test


def _geo_mean(values: Sequence[float]) -> float:
    return float(math.exp(sum(math.log(v) for v in values) / len(values)))
