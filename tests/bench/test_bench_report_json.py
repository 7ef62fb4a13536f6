"""Result files: lossless, and a run's per-request records one per line."""
import json
import math
import subprocess
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.report import load_json, write_json

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5),
                    st.floats(allow_nan=False, allow_infinity=False))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
    max_leaves=20)


@given(st.dictionaries(st.text(max_size=6), values, max_size=5))
def test_what_is_written_reads_back_equal(tmp_path_factory, result):
    path = tmp_path_factory.mktemp("json") / "result.json"
    write_json(result, path)
    assert load_json(path) == result


def test_per_request_records_take_a_line_each_and_infinities_become_strings(tmp_path):
    samples = [{"ttft_ms": 12.5, "chunk_tokens": [1, 1, 2]}, {"ttft_ms": 9.0, "chunk_tokens": []}]
    path = tmp_path / "run.json"
    write_json({"summary": {"goodput": math.inf}, "samples": samples}, path)
    lines = path.read_text().splitlines()
    assert [json.loads(line.strip().rstrip(",")) for line in lines[-4:-2]] == samples
    assert load_json(path)["summary"] == {"goodput": "inf"}


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                   check=True, capture_output=True)


def test_the_source_digest_names_the_commit_whose_tree_ran(tmp_path):
    """The digest of the files on disk equals the one read from a commit's blob ids, and
    moves with any change to a Python source (nothing else counts)."""
    import importlib.util

    from pdserve.bench.report import source_digest

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "source_revision.py"
    spec = importlib.util.spec_from_file_location("source_revision", script)
    finder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finder)
    for path, text in {"pdserve/a.py": "x = 1\n", "pdserve/sub/b.py": "y = 2\n",
                       "benchmarks/c.py": "z = 3\n", "pdserve/notes.md": "not code\n"}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    first = source_digest(tmp_path)
    assert first == finder.commit_digest("HEAD", tmp_path)
    (tmp_path / "pdserve/notes.md").write_text("edited, still not code\n")
    assert source_digest(tmp_path) == first
    (tmp_path / "pdserve/sub/b.py").write_text("y = 3\n")
    assert source_digest(tmp_path) != first
    _git(tmp_path, "commit", "-qam", "two")
    assert finder.commits_with(first, 10, tmp_path) == [
        subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=tmp_path, capture_output=True,
                       text=True, check=True).stdout.strip()]


def test_a_named_revision_read_from_a_stale_git_is_marked_dirty(tmp_path, monkeypatch):
    """``PDSERVE_GIT_REVISION=$(git rev-parse HEAD)`` run beside a ``.git`` of another
    commit than the tree's names that commit: the tree's changes say so."""
    from pdserve.bench.report import git_revision

    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path,
                          capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setenv("PDSERVE_GIT_REVISION", head)
    assert git_revision(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")  # the tree of a later commit, say
    assert git_revision(tmp_path) == head + "+dirty"
    monkeypatch.setenv("PDSERVE_GIT_REVISION", "abc1234")  # written out: taken as given
    assert git_revision(tmp_path) == "abc1234"
    monkeypatch.delenv("PDSERVE_GIT_REVISION")
    assert git_revision(tmp_path).endswith("+dirty")
