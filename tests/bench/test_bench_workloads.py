"""Workloads and arrivals: reproducible from a seed, with the documented shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.arrivals import gamma_arrivals
from pdserve.bench.sharegpt import served_tokenizer, sharegpt_workload
from pdserve.bench.spec import WorkloadSpec, parse_spec
from pdserve.bench.workloads import (
    BenchError,
    mooncake_workload,
    random_workload,
    rescale_arrivals,
    shaped_workload,
)

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"


def test_random_is_reproducible_and_in_range():
    a = random_workload(20, 100, 10, range_ratio=0.5, seed=3, vocab_size=1000)
    b = random_workload(20, 100, 10, range_ratio=0.5, seed=3, vocab_size=1000)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in a)
    assert all(max(r.prompt_token_ids) < 1000 for r in a)
    c = random_workload(20, 100, 10, range_ratio=0.5, seed=4, vocab_size=1000)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]


@pytest.mark.parametrize("name, prompt_range, output_range", [
    ("sharegpt", (100, 700), (80, 500)),
    ("loogle", (12000, 24000), (15, 70)),
])
def test_shaped_means(name, prompt_range, output_range):
    reqs = shaped_workload(name, 300, seed=0)
    prompts = np.mean([r.prompt_len for r in reqs])
    outputs = np.mean([r.output_len for r in reqs])
    assert prompt_range[0] < prompts < prompt_range[1]
    assert output_range[0] < outputs < output_range[1]


def test_max_context_clips_prompts():
    reqs = shaped_workload("loogle", 20, max_context=16384)
    assert all(r.prompt_len + r.output_len <= 16384 for r in reqs)


def test_mooncake_shares_blocks_and_keeps_lengths():
    reqs = mooncake_workload(SAMPLE, block_size=512, vocab_size=32000)
    assert len(reqs) == 50
    # The first rows of the sample all start with hash id 0: the same first 512 tokens.
    assert reqs[0].prompt_token_ids[:512] == reqs[1].prompt_token_ids[:512]
    assert reqs[0].prompt_token_ids[512:1024] != reqs[1].prompt_token_ids[512:1024]
    assert [r.prompt_len for r in reqs[:3]] == [6758, 7322, 7236]
    assert reqs[0].output_len == 500


def test_mooncake_window_cap_and_rescale():
    window = mooncake_workload(SAMPLE, start_s=3.0, duration_s=6.0)
    assert all(3000 <= r.meta["trace_timestamp_ms"] < 9000 for r in window)
    assert window[0].arrival_s == 0.0
    capped = mooncake_workload(SAMPLE, max_requests=7)
    assert len(capped) == 7
    times = rescale_arrivals([10.0, 12.0, 14.0, 20.0], rate=1.5)
    assert times[0] == 0.0 and times[-1] == pytest.approx(3 / 1.5)


def test_gamma_arrivals_rate_and_burstiness():
    poisson = np.diff(gamma_arrivals(4000, rate=10.0, seed=1))
    assert poisson.mean() == pytest.approx(0.1, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)
    smooth = np.diff(gamma_arrivals(4000, rate=10.0, burstiness=100.0, seed=1))
    assert smooth.std() / smooth.mean() == pytest.approx(0.1, rel=0.15)
    assert gamma_arrivals(3, math.inf) == [0.0, 0.0, 0.0]


def test_spec_parse_and_trace_offsets():
    base = WorkloadSpec(num_prompts=5, request_rate=2.0)
    spec = parse_spec(f"mooncake:trace={SAMPLE},num=50,trace_duration_s=none", base)
    assert spec.dataset == "mooncake" and spec.num_prompts == 50 and spec.request_rate == 2.0
    reqs = spec.build()
    assert spec.offsets(reqs)[-1] == pytest.approx(49 / 2.0)
    replay = parse_spec("mooncake:rate=inf", spec)
    assert replay.offsets(reqs) == [r.arrival_s for r in reqs]
    with pytest.raises(ValueError):
        parse_spec("random:bogus=1", base)


def _byte_tokenizer():
    return served_tokenizer(None, "tiny", "pdserve")


def _conversation(prompt: str, reply: str) -> dict:
    return {"id": prompt[:8], "conversations": [{"from": "human", "value": prompt},
                                                {"from": "gpt", "value": reply}]}


def test_sharegpt_filters_lengths_like_vllm(tmp_path):
    rows = [_conversation("a fine question", "a fine answer"),  # 16 + 13 tokens: kept
            _conversation("abc", "a long enough reply"),  # prompt 3 + BOS = 4: kept
            _conversation("ab", "a long enough reply"),  # prompt 3 < 4: skipped
            _conversation("a fine question", "no"),  # reply < 4: skipped
            _conversation("x" * 1024, "a fine answer"),  # prompt 1025 > 1024: skipped
            _conversation("y" * 40, "z" * 30)]  # 41 + 30 > max_context 64: skipped
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(rows))
    requests = sharegpt_workload(path, 2, _byte_tokenizer(), seed=3, max_context=64)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(4, 19), (16, 13)]
    with pytest.raises(BenchError, match="only 2 of 6 conversations fit"):
        sharegpt_workload(path, 3, _byte_tokenizer(), max_context=64)
    with pytest.raises(BenchError, match="needs the served model's tokenizer"):
        sharegpt_workload(path, 1, None)


def test_sharegpt_rejects_what_is_not_sharegpt(tmp_path):
    path = tmp_path / "x.json"
    for text, message in [("{\"id\": 1}", "expected a list of conversations"),
                          ("[1, 2]", "entry 0 is not a conversation"),
                          ("not json", "not readable JSON")]:
        path.write_text(text)
        with pytest.raises(BenchError, match=message):
            sharegpt_workload(path, 1, _byte_tokenizer())


def test_a_file_given_to_a_dataset_that_reads_none_is_an_error():
    with pytest.raises(BenchError, match="random reads no file"):
        WorkloadSpec(dataset="random", path="x.json").build()


def test_salted_prompts_are_fresh_but_keep_their_shared_prefixes():
    from pdserve.bench.workloads import FIRST_TOKEN_ID, mooncake_workload, salted

    requests = mooncake_workload(SAMPLE, vocab_size=1000, block_size=4)
    fresh = salted(requests, 7, 1000)
    assert [r.prompt_len for r in fresh] == [r.prompt_len for r in requests]
    for old, new in zip(requests, fresh, strict=True):
        assert all(a != b for a, b in zip(old.prompt_token_ids, new.prompt_token_ids,
                                            strict=True))
        assert all(FIRST_TOKEN_ID <= t < 1000 for t in new.prompt_token_ids)
    shared = lambda rs: [a.prompt_token_ids[:4] == b.prompt_token_ids[:4]
                         for a, b in zip(rs, rs[1:], strict=False)]
    assert shared(fresh) == shared(requests) and any(shared(requests))


def test_spread_takes_rows_over_the_whole_window():
    from pdserve.bench.workloads import load_trace

    rows = load_trace(SAMPLE)
    picked = load_trace(SAMPLE, max_requests=3, spread=True)
    assert picked[0] == rows[0] and picked[-1] == rows[-1] and len(picked) == 3
