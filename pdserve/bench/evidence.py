"""Goodput evidence gathered one recorded probe at a time, read back as tables.

A probe record (JSON) holds ``probe`` (``workload``, ``config``, ``rate``), ``created``,
``git_revision`` and ``samples`` (per-request records: ``success``, ``ttft_ms``, ``tpot_ms``).
Since the samples are kept, one probe answers for every SLO pair after the fact; a search is
therefore the curve of (rate, attainment) under one SLO pair, and its state (goodput, the
bracket, the next rate) follows from that curve alone (:mod:`pdserve.bench.goodput`).

Where several records share a (workload, config, rate), the newest (``created``) counts; a
row built from probes of several revisions says so.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.goodput import Bracket, next_rate, rate_bracket
from pdserve.bench.metrics import sample_attainment


@dataclass(frozen=True)
class SearchSpace:
    """One workload's SLO and the rates its searches may probe."""

    ttft_slo_ms: float
    ladder: tuple[float, ...]
    start_rate: float
    target: float = 0.9


@dataclass
class Search:
    """One (workload, config, TPOT SLO) search as the records leave it."""

    workload: str
    config: str
    tpot_slo_ms: float
    curve: list[tuple[float, float]] = field(default_factory=list)
    revisions: list[str] = field(default_factory=list)
    bracket: Bracket = field(default_factory=lambda: Bracket(0.0, None))
    next_rate: float | None = None
    requests: dict[float, int] = field(default_factory=dict)
    """Rate -> how many requests that probe sent."""

    @property
    def finished(self) -> bool:
        return self.next_rate is None and bool(self.curve)


def load_records(folder: Path) -> list[dict]:
    """Every probe record under ``folder`` (other JSON files are not probes)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "probe" in data and "samples" in data:
            records.append(data)
    return records


def runs_per_probe(records: list[dict]) -> dict[tuple[str, str, float], list[dict]]:
    """(workload, config, rate) -> every record of that probe, oldest first."""
    runs: dict[tuple[str, str, float], list[dict]] = {}
    for record in sorted(records, key=lambda r: r.get("created", "")):
        probe = record["probe"]
        runs.setdefault((probe["workload"], probe["config"], probe["rate"]), []).append(record)
    return runs


def newest_per_rate(records: list[dict]) -> dict[tuple[str, str], dict[float, dict]]:
    """(workload, config) -> rate -> the newest record of that probe."""
    table: dict[tuple[str, str], dict[float, dict]] = {}
    for (workload, config, rate), runs in runs_per_probe(records).items():
        table.setdefault((workload, config), {})[rate] = runs[-1]
    return table


def short_revision(record: dict) -> str:
    revision = record.get("git_revision") or "unknown"
    return revision[:7] + ("+dirty" if revision.endswith("+dirty") else "")


def search_of(workload: str, config: str, by_rate: dict[float, dict], space: SearchSpace,
              tpot_slo_ms: float) -> Search:
    curve = sorted((rate, sample_attainment(r["samples"], space.ttft_slo_ms, tpot_slo_ms) or 0.0)
                   for rate, r in by_rate.items())
    revisions = sorted({short_revision(r) for r in by_rate.values()})
    return Search(workload, config, tpot_slo_ms, curve, revisions,
                  rate_bracket(curve, space.target),
                  next_rate(curve, list(space.ladder), space.start_rate, space.target),
                  {rate: len(r["samples"]) for rate, r in by_rate.items()})


ExpectedRequests = Callable[[str, float], int]
"""(workload, rate) -> how many requests the workload's probe definition sends at that rate."""


def off_definition(search: Search, expected: ExpectedRequests | None) -> dict[float, int]:
    """Rate -> request count, for the probes that sent another number of requests than the
    definition (runs imported from before it): their queues had another span to build."""
    if expected is None:
        return {}
    return {rate: n for rate, n in search.requests.items()
            if n != expected(search.workload, rate)}


def searches(records: list[dict], wanted: list[tuple[str, str, float]],
             spaces: dict[str, SearchSpace]) -> list[Search]:
    """The state of every wanted (workload, config, TPOT SLO) search, probed or not."""
    table = newest_per_rate(records)
    return [search_of(w, c, table.get((w, c), {}), spaces[w], slo) for w, c, slo in wanted]


# --- tables -----------------------------------------------------------------------------------

def goodput_cell(search: Search, ladder: tuple[float, ...]) -> str:
    text = search.bracket.describe(list(ladder))
    return text if search.finished or not search.curve else f"{text} (searching)"


def main_revision(found: list[Search]) -> str | None:
    """The revision most probes of the table come from; rows off it get marked."""
    counts = Counter(rev for s in found for rev in s.revisions)
    return counts.most_common(1)[0][0] if counts else None


def goodput_table(found: list[Search], spaces: dict[str, SearchSpace],
                  workloads: list[str], configs: list[str],
                  expected: ExpectedRequests | None = None) -> str:
    """Markdown: one row per config, one goodput column per workload (req/s); cells whose
    probes are not (only) from the table's main revision carry † and their revisions; cells
    with a probe off the workload's request count (``expected``) carry ‡."""
    cells = {(s.workload, s.config): s for s in found}
    main = main_revision(found)
    lines = ["| configuration | " + " | ".join(f"{w} (req/s)" for w in workloads) + " |",
             "|---" * (len(workloads) + 1) + "|"]
    for config in configs:
        row = [_table_cell(cells.get((w, config)), spaces[w], main, expected)
               for w in workloads]
        lines.append(f"| {config} | " + " | ".join(row) + " |")
    if main and any("†" in line for line in lines):
        lines.append(f"\n† probes from a revision other than {main} (the revision of most "
                     "probes): not the same code.")
    if any("‡" in line for line in lines):
        lines.append("\n‡ a probe of this search sent another number of requests than the "
                     "workload's definition (a run imported from before it; the attainment "
                     "table names it): its queue had a longer or shorter span to build.")
    return "\n".join(lines)


def _table_cell(search: Search | None, space: SearchSpace, main: str | None,
                expected: ExpectedRequests | None) -> str:
    if search is None:
        return "-"
    text = goodput_cell(search, space.ladder)
    if search.revisions and search.revisions != [main]:
        text += f" † ({', '.join(search.revisions)})"
    if off_definition(search, expected):
        text += " ‡"
    return text


def attainment_table(search: Search, expected: ExpectedRequests | None = None) -> str:
    off = off_definition(search, expected)
    rates = " ".join(f"{rate:g}: {100 * a:.0f}%" + (f" ({off[rate]} requests)" if rate in off
                                                    else "")
                     for rate, a in search.curve) or "no probes"
    redo = reprobe_rate(search, expected)
    nxt = f"re-probe {redo:g}" if redo is not None else "done" if search.finished \
        else f"next {search.next_rate:g}" if search.next_rate is not None else "-"
    return (f"| {search.workload} | {search.config} | {search.tpot_slo_ms:g} | {rates} | "
            f"{search.bracket.describe()} | {nxt} | {', '.join(search.revisions) or '-'} |")


ATTAINMENT_HEADER = ("| workload | config | TPOT SLO (ms) | attainment by rate (req/s) | "
                     "goodput | search | revisions |\n|---|---|---|---|---|---|---|")


def reprobe_rate(search: Search, expected: ExpectedRequests | None) -> float | None:
    """The failing rate that ends a finished search, when its probe is off the definition:
    a longer run's failure does not show that the defined one fails, so it is run again."""
    high = search.bracket.high
    if search.finished and high is not None and high in off_definition(search, expected):
        return high
    return None


def missing_probes(found: list[Search], expected: ExpectedRequests | None = None
                   ) -> list[tuple[str, str, float]]:
    """(workload, config, rate) each unfinished search needs next, and the re-probes of
    off-definition failures that end a search, without repeats."""
    out: list[tuple[str, str, float]] = []
    for search in found:
        rate = search.next_rate if search.next_rate is not None \
            else reprobe_rate(search, expected)
        probe = (search.workload, search.config, rate)
        if rate is not None and probe not in out:
            out.append(probe)
    return out


def figure3_points(found: list[Search], family_of) -> dict[str, list[tuple[float, Bracket]]]:
    """Series name -> (ITL SLO, goodput bracket), from searches ``family_of(config)`` names
    (None: not drawn)."""
    series: dict[str, list[tuple[float, Bracket]]] = {}
    for search in found:
        name = family_of(search.config)
        if name is not None and search.curve:
            series.setdefault(name, []).append((search.tpot_slo_ms, search.bracket))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in series.items()}
