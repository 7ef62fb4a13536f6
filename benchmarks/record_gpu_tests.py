"""Appends one GPU test run (a pytest JUnit XML report) to ``gpu_tests_h200.json``.

On the GPU machine:

    python -m pytest -q -m gpu tests --junitxml=gpu_tests.xml

then here:

    python benchmarks/record_gpu_tests.py gpu_tests.xml --revision <commit> \
        --command "python -m pytest -q -m gpu tests"

Each test case is recorded with its outcome and duration; the summary line counts them.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

DEFAULT_RECORD = Path(__file__).parent / "results" / "gpu_tests_h200.json"


def cases_from_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "seconds": round(float(case.get("time", 0)), 3)})
    return cases


def summary(cases: list[dict]) -> str:
    counts = Counter(c["outcome"] for c in cases)
    seconds = sum(c["seconds"] for c in cases)
    parts = [f"{n} {outcome}" for outcome, n in sorted(counts.items())]
    return f"{', '.join(parts)} in {seconds:.1f}s (test time)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--revision", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--note", default="")
    parser.add_argument("--record", type=Path, default=DEFAULT_RECORD)
    args = parser.parse_args()
    record = json.loads(args.record.read_text())
    cases = cases_from_junit(args.junit_xml)
    run = {"command": args.command, "git_revision": args.revision, "summary": summary(cases),
           "note": args.note, "cases": cases}
    record["runs"].append(run)
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    print(run["summary"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
