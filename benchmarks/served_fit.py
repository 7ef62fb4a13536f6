"""The latency fit a recorded run planned with, for replays that carry its corrections.

An engine loads its ``--mux-predictor`` file as saved, and every correction it records
(``engine_calibration``, a timeline's ``calibration``, a probe record's learned factors) is
its steps' measured time over that fit's predictions. ``LatencyPredictor.load`` refits a
file of an older format from its rows, so a replay that loads it would set those
corrections on another model (refitted to format 4 with GEMM tile steps in every group,
the 8ccd9ac validation's replay came 39% under its measured TTFT P50, 9.5% with the fit it
ran). The saved fit gives the predictions the engine recorded in its timelines (to float
rounding).
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.sched.predictor import FORMAT_VERSION, LatencyPredictor

# Format 3 priced all prefix pairs of a prefill piece at one coefficient (this one of its
# six) and had no GEMM tile steps; format 4 splits the pairs at a piece's first tokens, so
# both halves take that coefficient and the tiles none: the same predictions.
_PREFIX_PAIRS_COEF = 4
_FORMAT_4 = 4


def served_predictor(path: str | Path) -> LatencyPredictor:
    """The fit saved in a predictor file, as the engine that loaded it planned with it
    (format 3 or the current one; any other is refused by ``from_json``)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") == 3 and FORMAT_VERSION == _FORMAT_4:
        data = {**data, "format": _FORMAT_4, "fits": [_format_4_fit(f) for f in data["fits"]]}
    return LatencyPredictor.from_json(data)


def _format_4_fit(fit: dict) -> dict:
    if fit["phase"] != "prefill":
        return fit  # decode features did not change
    coef = list(fit["coef"])
    return {**fit, "coef": [*coef, coef[_PREFIX_PAIRS_COEF], 0.0]}
