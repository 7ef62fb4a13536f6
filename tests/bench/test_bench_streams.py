"""What the client reads from a stream, through a stand-in server that can produce each case:
several tokens per chunk, text held back, counts stated three ways or not at all, refusals."""

from __future__ import annotations

import json

from bench_standin import StandIn, ThreadedServer, free_port

from pdserve.bench.cli import main
from pdserve.bench.metrics import chunk_tokens_of
from pdserve.bench.workloads import random_workload


def _serve(url: str, out, *extra: str) -> int:
    return main(["serve", "--base-url", url, "--num-prompts", "4", "--random-input-len", "16",
                 "--random-output-len", "8", "--request-rate", "inf", "--no-progress",
                 "--no-timeline", "--warmup-requests", "0", "--out", str(out), *extra])


def test_several_tokens_per_chunk_counted_from_continuous_usage(tmp_path):
    # Chunks of 2, 1, 3, 2 tokens; the first one's text is held back (empty).
    standin = StandIn(prefill_ms=1, itl_ms=1, chunk_tokens=(2, 1, 3), held_back=frozenset({0}))
    with ThreadedServer(standin) as server:
        assert _serve(server.url, tmp_path / "r.json") == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert standin.requests[0]["stream_options"]["continuous_usage_stats"] is True
    assert result["token_counts"] == {"exact": True, "sources": {"usage": 4}}
    for sample in result["samples"]:
        # TTFT is taken at the empty-text first chunk: it carries two tokens.
        assert chunk_tokens_of(sample) == [2, 1, 3, 2] and sample["count_source"] == "usage"
        # One ITL sample per token after the first chunk (1 + 3 + 2).
        assert len(sample["itl_ms"]) == 6 and sample["output_tokens"] == 8


def test_logprobs_give_the_counts_when_usage_stats_are_not_streamed(tmp_path):
    standin = StandIn(prefill_ms=1, itl_ms=1, chunk_tokens=(3,), usage_stats=False)
    with ThreadedServer(standin) as server:
        assert _serve(server.url, tmp_path / "r.json", "--extra-body", '{"logprobs": 0}') == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["token_counts"] == {"exact": True, "sources": {"logprobs": 4}}
    assert all(chunk_tokens_of(s) == [3, 3, 2] and len(s["itl_ms"]) == 5
               for s in result["samples"])


def test_a_stream_without_counts_is_flagged_approximate(tmp_path, capsys):
    standin = StandIn(prefill_ms=1, itl_ms=1, chunk_tokens=(2,), usage_stats=False)
    with ThreadedServer(standin) as server:
        assert _serve(server.url, tmp_path / "r.json") == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["token_counts"] == {"exact": False, "sources": {"text": 4}}
    # Four text chunks of two tokens each: counted as four tokens, the final usage says 8.
    assert all(chunk_tokens_of(s) == [1, 1, 1, 1] and s["output_tokens"] == 8
               for s in result["samples"])
    assert "approximate" in capsys.readouterr().err


def test_every_request_refused_exits_nonzero_with_the_error(tmp_path, capsys):
    with ThreadedServer(StandIn(prefill_ms=1, itl_ms=1)) as server:
        code = _serve(server.url, tmp_path / "r.json", "--model", "no-such-model")
    assert code == 1
    err = capsys.readouterr().err
    assert "4 of 4 requests failed" in err
    assert "4 x HTTP 404" in err and "no-such-model" in err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["errors"][0]["count"] == 4 and result["failed"] == 4


def test_some_prompts_too_long_are_counted_and_shown(tmp_path, capsys):
    args = dict(num=12, input_len=60, output_len=8, range_ratio=0.5, seed=0, vocab_size=256)
    too_long = sum(r.prompt_len + r.output_len > 64 for r in random_workload(**args))
    assert 0 < too_long < 12  # the workload mixes both cases
    with ThreadedServer(StandIn(prefill_ms=1, itl_ms=1, max_context=64)) as server:
        code = main(["serve", "--base-url", server.url, "--num-prompts", "12",
                     "--random-input-len", "60", "--random-output-len", "8",
                     "--random-range-ratio", "0.5", "--no-progress", "--no-timeline",
                     "--warmup-requests", "0", "--out", str(tmp_path / "r.json")])
    assert code == 1
    err = capsys.readouterr().err
    assert f"{too_long} of 12 requests failed" in err
    assert f"{too_long} x HTTP 400" in err and "maximum context length" in err


def test_unreachable_server_stops_before_the_run(tmp_path, capsys):
    code = _serve(f"http://127.0.0.1:{free_port()}", tmp_path / "r.json")
    assert code == 2
    assert "cannot reach http://127.0.0.1:" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_host_and_port_name_the_server(tmp_path, capsys):
    with ThreadedServer(StandIn(prefill_ms=1, itl_ms=1)) as server:
        code = main(["serve", "--host", "127.0.0.1", "--port", str(server.port),
                     "--num-prompts", "2", "--random-input-len", "8", "--random-output-len",
                     "2", "--no-progress", "--no-timeline", "--out", str(tmp_path / "r.json")])
        assert code == 0
        both = main(["serve", "--base-url", server.url, "--port", str(server.port)])
    assert both == 2 and "either --base-url or --host/--port" in capsys.readouterr().err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["base_url"] == f"http://127.0.0.1:{server.port}"
    assert result["completed"] == 2


def test_a_stream_whose_text_is_all_held_back_names_the_cause(tmp_path, capsys):
    standin = StandIn(prefill_ms=1, itl_ms=1, held_back=frozenset(range(8)), usage_stats=False)
    with ThreadedServer(standin) as server:
        assert _serve(server.url, tmp_path / "r.json") == 1
    err = capsys.readouterr().err
    assert "4 of 4 requests failed" in err
    assert "the server reports 8 tokens, but no chunk had text or a token count" in err


def _word_tokenizer(folder) -> None:
    """A tokenizer.json of a few whole words (the Hugging Face format, written here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "how", "do", "plants", "make", "food", "?", "by", "light", "they", "grow"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))


def test_sharegpt_file_with_a_given_tokenizer(tmp_path, capsys):
    _word_tokenizer(tmp_path / "tok")
    conversation = [{"from": "human", "value": "how do plants make food ?"},
                    {"from": "gpt", "value": "by light they grow"}]
    (tmp_path / "sg.json").write_text(json.dumps([{"id": "1", "conversations": conversation}]))
    standin = StandIn(prefill_ms=1, itl_ms=1)
    with ThreadedServer(standin) as server:
        code = _serve(server.url, tmp_path / "r.json", "--dataset-name", "sharegpt",
                      "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "1",
                      "--tokenizer", str(tmp_path / "tok"))
        unknown = _serve(server.url, tmp_path / "r2.json", "--dataset-name", "sharegpt",
                         "--dataset-path", str(tmp_path / "sg.json"), "--num-prompts", "1")
    assert code == 0
    assert standin.requests[0]["prompt"] == [1, 2, 3, 4, 5, 6]
    assert standin.requests[0]["max_tokens"] == 4
    # A peer serving a model whose tokenizer is not known here: asked for, not guessed.
    assert unknown == 2 and "pass --tokenizer" in capsys.readouterr().err
    assert len(standin.requests) == 1


def test_a_reasoning_delta_counts_as_output_when_nothing_states_counts():
    from pdserve.bench.client import ChunkCounter

    counter = ChunkCounter()
    assert counter.count({}, {"delta": {"reasoning": "Let me"}}) == (1, "text")
    assert counter.count({}, {"delta": {"reasoning_content": "see"}}) == (1, "text")
    assert counter.count({}, {"delta": {"role": "assistant"}}) == (0, "text")
