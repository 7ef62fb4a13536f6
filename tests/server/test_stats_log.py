"""The engine's periodic stats line: rates over each interval, quiet while idle, and the
real server logging it (or not, with --disable-log-stats)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pdserve.messages import EngineStats
from pdserve.server.app import start_stats_log
from pdserve.server.config import ServerConfig
from pdserve.server.stats_log import StatsLine


def stats(prompt: int = 0, generated: int = 0, running: int = 0, waiting: int = 0,
          queries: int = 0, hits: int = 0, preempted: int = 0, kv: float = 0.0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=waiting, kv_usage=kv,
                       prefix_cache_queries=queries, prefix_cache_hits=hits,
                       prompt_tokens_total=prompt, generation_tokens_total=generated,
                       num_preemptions=preempted)


def test_each_line_gives_the_intervals_rates_and_the_state_now():
    line = StatsLine(stats(), now=0.0)
    assert line.next(stats(), now=10.0) is None  # idle from the start: nothing to say
    text = line.next(stats(prompt=5000, generated=300, running=3, waiting=2, queries=4,
                           hits=1, kv=0.125), now=20.0)
    assert text == ("engine: prompt 500.0 tokens/s, generation 30.0 tokens/s; running 3, "
                    "waiting 2 requests; KV cache 12.5% used; prefix cache hit rate 25.0%")
    text = line.next(stats(prompt=5000, generated=700, running=1, queries=4, hits=1,
                           preempted=2), now=25.0)
    assert "generation 80.0 tokens/s" in text and "prompt 0.0 tokens/s" in text
    assert text.endswith("; 2 preempted") and "hit rate 0.0%" in text
    # the first idle interval is said once (the rates fall to zero), then nothing
    assert "running 0, waiting 0" in line.next(stats(prompt=5000, generated=700), now=35.0)
    assert line.next(stats(prompt=5000, generated=700), now=45.0) is None


def test_a_restarted_engine_counts_from_zero():
    line = StatsLine(stats(prompt=9000, generated=900), now=0.0)
    text = line.next(stats(prompt=100, generated=20, running=1), now=10.0)
    assert "prompt 10.0 tokens/s, generation 2.0 tokens/s" in text


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_the_interval_must_be_positive(interval):
    with pytest.raises(ValueError, match="--log-stats-interval-s must be > 0"):
        ServerConfig(log_stats_interval_s=interval)


def wait_for_line(server, timeout: float = 20.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [x for x in server.log_text().splitlines() if "engine: prompt" in x]
        if lines:
            return lines[0]
        time.sleep(0.1)
    return None


def test_the_server_logs_the_line_while_it_works(launch):
    logging = launch("--log-stats-interval-s", "0.2")
    logging.openai().completions.create(model="tiny", prompt="hello", max_tokens=8)
    line = wait_for_line(logging)
    assert line is not None, logging.log_text()
    assert "tokens/s" in line and "KV cache" in line


def test_no_line_when_told():
    client = SimpleNamespace(stats=EngineStats())
    assert start_stats_log(client, ServerConfig(disable_log_stats=True)) is None
