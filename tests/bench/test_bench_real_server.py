"""The harness through the real server and the in-process engine on the tiny model (CPU)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shlex
import sys

import pytest
from bench_standin import free_port

from pdserve.bench.cli import main
from pdserve.bench.compare import DEFAULT_SERVER_CMD, ManagedServer
from pdserve.bench.metrics import chunk_tokens_of


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


needs_server = pytest.mark.skipif(
    not (_importable("pdserve.server.app") and _importable("pdserve.__main__")),
    reason="pdserve.server is not importable yet (the server lands separately)")
needs_engine = pytest.mark.skipif(not _importable("pdserve.engine.core"),
                                  reason="pdserve.engine.core is not importable yet")


@pytest.mark.slow
@needs_server
def test_compare_through_real_server_on_tiny(tmp_path):
    out = tmp_path / "tiny.json"
    code = main(["compare", "--model", "tiny", "--port", str(free_port()),
                 "--config", "chunked64=--schedule chunked --chunk-size 64",
                 "--config", "multiplex=--schedule multiplex --itl-slo-ms 200",
                 "--workload", "random:num=6,rate=8,input_len=48,output_len=6,range_ratio=0.5",
                 "--ttft-slo-ms", "5000", "--itl-slo-ms", "1000", "--no-progress",
                 "--timeline-interval-ms", "50", "--startup-timeout-s", "240",
                 "--out", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == ["chunked64", "multiplex"]
    for run in runs:
        assert "error" not in run, run.get("error")
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["token_counts"] == {"exact": True, "sources": {"usage": 6}}
        for s in run["samples"]:
            # return_engine_timing: every token is counted even when its text is held back,
            # and one chunk may carry several (the first one too, when the stream's
            # listener attaches after two steps): one ITL sample per token after it.
            assert s["output_tokens"] == s["output_len"] == sum(chunk_tokens_of(s))
            assert len(s["itl_ms"]) == s["output_len"] - chunk_tokens_of(s)[0]
        assert run["ttft_ms"]["p50"] > 0 and 0.0 <= run["slo_attainment"] <= 1.0
        assert any("pdserve_num_requests_running" in s for s in run["timeline"])
    # Each engine's timeline lands on the run's time axis: chunked prefill's steps (every
    # prompt token in one of them), the multiplex engine's SM-split decisions.
    steps = runs[0]["engine_timeline"]
    assert steps and all(-1.0 < e["t"] < runs[0]["duration_s"] + 1.0 for e in steps)
    assert {e["mode"] for e in steps} <= {"mixed", "prefill_only", "decode_only"}
    assert sum(e["prefill_tokens"] for e in steps) == sum(
        s["prompt_len"] for s in runs[0]["samples"])
    assert list((tmp_path / "plots").glob("split_chunked64_*.png"))
    split = runs[1]["engine_timeline"]
    assert split and all(-1.0 < e["t"] < runs[1]["duration_s"] + 1.0 for e in split)
    assert {e["mode"] for e in split} <= {"spatial", "temporal", "prefill_only", "decode_only"}
    assert list((tmp_path / "plots").glob("split_multiplex_*.png"))


@pytest.mark.slow
@needs_engine
def test_in_process_engine_backend(tmp_path):
    out = tmp_path / "engine.json"
    code = main(["serve", "--backend", "engine", "--model", "tiny",
                 "--engine-arg", "schedule=chunked", "--engine-arg", "chunk_size=64",
                 "--num-prompts", "5", "--random-input-len", "40", "--random-output-len", "5",
                 "--request-rate", "20", "--ttft-slo-ms", "5000", "--itl-slo-ms", "1000",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 5, [s["error"] for s in result["samples"]]
    assert all(s["output_tokens"] == 5 and len(s["itl_ms"]) == 4 for s in result["samples"])
    assert any(step["batch_requests"] > 0 for step in result["timeline"])


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """``pdserve serve tiny`` on a free port, for the tests below."""
    port = free_port()
    command = shlex.split(DEFAULT_SERVER_CMD.format(model="tiny", port=port))
    server = ManagedServer(command, port, tmp_path_factory.mktemp("tiny") / "server.log")
    server.start()
    try:
        asyncio.run(server.wait_healthy(240))
        yield port
    finally:
        server.stop()


def _serve(port: int, out, *extra: str) -> int:
    return main(["serve", "--host", "127.0.0.1", "--port", str(port), "--no-progress",
                 "--no-timeline", "--warmup-requests", "0", "--out", str(out), *extra])


@pytest.mark.slow
@needs_server
def test_counts_every_token_of_a_pdserve_stream(tiny_server, tmp_path):
    out = tmp_path / "r.json"
    assert _serve(tiny_server, out, "--num-prompts", "6", "--random-input-len", "24",
                  "--random-output-len", "24", "--request-rate", "inf") == 0
    result = json.loads(out.read_text())
    assert result["config"]["extra_body"] == {"return_engine_timing": True}
    assert result["token_counts"] == {"exact": True, "sources": {"usage": 6}}
    for s in result["samples"]:
        assert sum(chunk_tokens_of(s)) == s["output_tokens"] == 24
        assert len(s["itl_ms"]) == 24 - chunk_tokens_of(s)[0]


@pytest.mark.slow
@needs_server
def test_counts_without_stated_tokens_are_flagged(tiny_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert _serve(tiny_server, out, "--num-prompts", "2", "--random-input-len", "8",
                  "--random-output-len", "8",  # no running usage, no num_tokens:
                  "--extra-body", '{"stream_options": {"include_usage": true}}') == 0
    result = json.loads(out.read_text())
    assert result["token_counts"]["exact"] is False
    assert "approximate" in capsys.readouterr().err


@pytest.mark.slow
@needs_server
def test_refused_requests_exit_nonzero_with_reasons(tiny_server, tmp_path, capsys):
    wrong_model = _serve(tiny_server, tmp_path / "a.json", "--model", "nope",
                         "--num-prompts", "3", "--random-input-len", "8",
                         "--random-output-len", "2")
    err = capsys.readouterr().err
    assert wrong_model == 1 and "3 of 3 requests failed" in err and "model_not_found" in err
    too_long = _serve(tiny_server, tmp_path / "b.json", "--num-prompts", "2",
                      "--random-input-len", "5000", "--random-output-len", "2")
    err = capsys.readouterr().err
    assert too_long == 1 and "2 of 2 requests failed" in err
    assert "2 x HTTP 400" in err and "context" in err


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "How do plants make food?"},
                                  {"from": "gpt", "value": "By photosynthesis, from light."}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be brief."},
                                  {"from": "human", "value": "Name a prime above ten."},
                                  {"from": "gpt", "value": "Eleven is one."}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Hi"},  # too short: skipped
                                  {"from": "gpt", "value": "Hello there, how can I help?"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "Only a question, no reply."}]},
]


@pytest.mark.slow
@needs_server
def test_sharegpt_file_through_the_served_tokenizer(tiny_server, tmp_path):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(SHAREGPT))
    out = tmp_path / "r.json"
    assert _serve(tiny_server, out, "--dataset-name", "sharegpt", "--dataset-path",
                  str(data), "--num-prompts", "2") == 0
    result = json.loads(out.read_text())
    assert result["workload"]["lengths"] == "file" and result["completed"] == 2
    # pdserve serves the tiny preset with its byte-level tokenizer: bytes + BOS, reply bytes.
    expected = {(len(c[0]["value"]) + 1, len(c[1]["value"])) for c in
                (SHAREGPT[0]["conversations"], SHAREGPT[1]["conversations"][1:])}
    assert {(s["prompt_len"], s["output_len"]) for s in result["samples"]} == expected
    assert all(s["output_tokens"] == s["output_len"] for s in result["samples"])


@pytest.mark.slow
@needs_server
def test_sharegpt_file_missing_or_malformed(tiny_server, tmp_path, capsys):
    missing = _serve(tiny_server, tmp_path / "r.json", "--dataset-name", "sharegpt",
                     "--dataset-path", str(tmp_path / "absent.json"))
    assert missing == 2 and "ShareGPT file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"id": "x", "turns": []}]))
    malformed = _serve(tiny_server, tmp_path / "r.json", "--dataset-name", "sharegpt",
                       "--dataset-path", str(bad))
    assert malformed == 2 and "entry 0 is not a conversation" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
