"""The caching allocator's growth after start-up is reported, and the CPU says why not."""

from __future__ import annotations

import torch

from pdserve.engine import allocator_watch
from pdserve.engine.allocator_watch import RESERVED, RETRIES, SEGMENTS, AllocatorWatch
from pdserve.engine.llm import LLM


def test_the_watch_reports_what_the_allocator_took_after_serving_began(monkeypatch):
    stats = {SEGMENTS: 40, RETRIES: 0, RESERVED: 10 * 2**30}
    monkeypatch.setattr(allocator_watch.torch.cuda, "memory_stats", lambda device: dict(stats))
    monkeypatch.setattr(allocator_watch.torch.cuda, "memory_stats_as_nested_dict",
                        lambda device: {"segment": {"all": {"allocated": stats[SEGMENTS]}}})
    watch = AllocatorWatch(torch.device("cuda", 0))
    assert watch.describe() == {"watched": False, "why": "not serving yet"}
    watch.serving()  # the start-up's segments are expected
    stats.update({SEGMENTS: 43, RETRIES: 1, RESERVED: 10 * 2**30 + 96 * 2**20})
    assert watch.describe() == {"watched": True, "cuda_mallocs": 3, "alloc_retries": 1,
                                "reserved_growth_mib": 96.0}
    assert watch.segments() == 43  # what a launch's reads around it subtract


def test_on_the_cpu_nothing_is_watched_and_the_engine_says_why():
    info = LLM("tiny", device="cpu").engine.describe()["allocator_while_serving"]
    assert info == {"watched": False, "why": "no caching CUDA allocator on cpu"}
