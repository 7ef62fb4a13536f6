"""Goodput: the highest request rate whose SLO attainment is >= a target (DistServe: 90%).

Two searches over a measuring function ``measure(rate) -> (attainment, summary)``:

- ``sweep_goodput``: probe a given list of rates; goodput is the highest passing rate below
  the lowest failing one (a lucky pass above a failure is noise, not capacity).
- ``search_goodput``: from a start rate, double (or halve) until the pass/fail boundary is
  bracketed, then bisect until the bracket is within ``rel_tol``. Each probe is a full run
  of the same seeded workload, so probes differ only in their arrival rate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Measure = Callable[[float], Awaitable[tuple[float, dict]]]


@dataclass
class GoodputResult:
    goodput_rps: float
    target: float
    points: list[dict] = field(default_factory=list)
    """Every probe: ``{"rate", "attainment", "summary"}``, in probe order."""
    bracketed: bool = True
    """False when no probed rate failed: goodput is then only a lower bound."""

    def curve(self) -> list[tuple[float, float]]:
        return sorted((p["rate"], p["attainment"]) for p in self.points)


class _Prober:
    def __init__(self, measure: Measure, target: float) -> None:
        self.measure = measure
        self.target = target
        self.points: list[dict] = []

    async def passes(self, rate: float) -> bool:
        attainment, summary = await self.measure(rate)
        self.points.append({"rate": rate, "attainment": attainment, "summary": summary})
        return attainment >= self.target


def goodput_from_curve(curve: list[tuple[float, float]], target: float) -> float:
    best = 0.0
    for rate, attainment in sorted(curve):
        if attainment < target:
            break
        best = rate
    return best


async def sweep_goodput(measure: Measure, rates: list[float],
                        target: float = 0.9) -> GoodputResult:
    prober = _Prober(measure, target)
    for rate in sorted(rates):
        await prober.passes(rate)
    result = GoodputResult(0.0, target, prober.points)
    result.goodput_rps = goodput_from_curve(result.curve(), target)
    result.bracketed = any(p["attainment"] < target for p in prober.points)
    return result


async def _bracket(prober: _Prober, start: float, min_rate: float, max_rate: float,
                   max_probes: int) -> tuple[float, float | None]:
    """(highest passing rate or 0, lowest failing rate or None when none failed)."""
    rate = start
    if await prober.passes(rate):
        while rate < max_rate and len(prober.points) < max_probes:
            higher = min(rate * 2, max_rate)
            if not await prober.passes(higher):
                return rate, higher
            rate = higher
        return rate, None
    while rate / 2 >= min_rate and len(prober.points) < max_probes:
        lower = rate / 2
        if await prober.passes(lower):
            return lower, rate
        rate = lower
    return 0.0, rate


async def search_goodput(measure: Measure, start_rate: float = 1.0, min_rate: float = 0.01,
                         max_rate: float = 1024.0, target: float = 0.9, rel_tol: float = 0.1,
                         max_probes: int = 12) -> GoodputResult:
    prober = _Prober(measure, target)
    low, high = await _bracket(prober, start_rate, min_rate, max_rate, max_probes)
    while high is not None and low > 0 and len(prober.points) < max_probes:
        if (high - low) / high <= rel_tol:
            break
        mid = (low + high) / 2
        if await prober.passes(mid):
            low = mid
        else:
            high = mid
    return GoodputResult(low, target, prober.points, bracketed=high is not None)


# --- a search carried across sessions ---------------------------------------------------------
# When every probe is a separate, recorded run (a device budget allows only a few at a time),
# the search state is the curve measured so far: these functions read it and name the next
# rate on a fixed ladder, so runs made in different sessions land on the same rates.


@dataclass(frozen=True)
class Bracket:
    """What a curve says about goodput: ``low`` passed (0: nothing passed), ``high`` failed
    (None: nothing failed above ``low``)."""

    low: float
    high: float | None

    def describe(self, ladder: list[float] | None = None) -> str:
        """``0.3``, ``between 0.2 and 0.4``, ``>= 0.5``, ``< 0.1`` (req/s)."""
        if self.high is None:
            return f">= {self.low:g}" if self.low > 0 else "not probed"
        if self.low == 0:
            return f"< {self.high:g}"
        if ladder is not None and not _ladder_between(ladder, self.low, self.high):
            return f"{self.low:g}"
        return f"between {self.low:g} and {self.high:g}"


def rate_bracket(curve: list[tuple[float, float]], target: float = 0.9) -> Bracket:
    """Goodput (as :func:`goodput_from_curve`) and the lowest failing rate above it."""
    if not curve:
        return Bracket(0.0, None)
    low = goodput_from_curve(curve, target)
    failing = [rate for rate, attainment in curve if attainment < target and rate > low]
    return Bracket(low, min(failing) if failing else None)


def _ladder_between(ladder: list[float], low: float, high: float) -> list[float]:
    return [rate for rate in sorted(ladder) if low < rate < high]


def next_rate(curve: list[tuple[float, float]], ladder: list[float], start: float,
              target: float = 0.9) -> float | None:
    """The next rate of a doubling-then-bisecting search on ``ladder``, given the rates
    measured so far; None when the ladder cannot narrow the bracket further."""
    if not curve:
        return start
    bracket = rate_bracket(curve, target)
    rungs = sorted(ladder)
    if bracket.high is None:  # nothing failed yet: about double the best pass
        above = [r for r in rungs if bracket.low < r <= 2 * bracket.low]
        return above[-1] if above else next((r for r in rungs if r > bracket.low), None)
    if bracket.low == 0:  # everything probed failed: about halve the lowest failure
        below = [r for r in rungs if bracket.high / 2 <= r < bracket.high]
        return below[0] if below else next((r for r in reversed(rungs) if r < bracket.high),
                                           None)
    inside = _ladder_between(rungs, bracket.low, bracket.high)
    return inside[len(inside) // 2] if inside else None
