"""Result files: lossless, and a run's per-request records one per line."""
import json
import math

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
