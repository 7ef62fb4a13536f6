"""The commits whose code a result ran: match its ``source_digest`` against the history.

Every result header carries ``git_revision`` and ``source_digest`` (``pdserve.bench.report``).
The revision comes from the ``.git`` beside the tree, or from ``PDSERVE_GIT_REVISION``; where
the tree was copied beside a ``.git`` of another commit, that reads the other commit. The
digest is computed from the files that ran, so it names the code whatever the git metadata
says. This lists the commits (newest first) whose tree has that digest::

    python benchmarks/source_revision.py benchmarks/results/some_result.json
    python benchmarks/source_revision.py 3f9c...e1 --max-count 500

None found: the code that ran was never committed as it was (local changes), or is older
than ``--max-count`` commits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.report import SOURCE_FOLDERS, digest_of_blobs, load_json  # noqa: E402


def commit_digest(commit: str, root: Path = ROOT) -> str:
    """``source_digest`` of ``commit``'s tree, from its blob ids (no file is read)."""
    listing = subprocess.run(["git", "ls-tree", "-r", commit, "--", *SOURCE_FOLDERS],
                             cwd=root, capture_output=True, text=True, check=True).stdout
    blobs = {}
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        kind, blob = meta.split()[1:3]
        if kind == "blob" and path.endswith(".py"):
            blobs[path] = blob
    return digest_of_blobs(blobs)


def commits_with(digest: str, max_count: int, root: Path = ROOT) -> list[str]:
    commits = subprocess.run(["git", "rev-list", f"--max-count={max_count}", "HEAD"], cwd=root,
                             capture_output=True, text=True, check=True).stdout.split()
    return [c for c in commits if commit_digest(c, root) == digest]


def digest_of(argument: str) -> str:
    """A digest given as is, or the ``source_digest`` of a result file."""
    if Path(argument).is_file():
        result = load_json(argument)
        if "source_digest" not in result:
            raise SystemExit(f"{argument} records no source_digest (written before it was)")
        return result["source_digest"]
    return argument


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("digest", help="a source_digest, or a result JSON (.gz too) with one")
    parser.add_argument("--max-count", type=int, default=300,
                        help="commits searched, newest first")
    args = parser.parse_args()
    digest = digest_of(args.digest)
    found = commits_with(digest, args.max_count)
    print(json.dumps({"digest": digest, "commits": found}))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
