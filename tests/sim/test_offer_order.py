"""The gateway's prefill offer order, handed out lazily from a heap, is exactly the full
sort it replaced: fewest in flight first, ties by instance id, then by position."""

from __future__ import annotations

import random
from collections import Counter

from pdserve.cluster.gateway import order_prefill
from pdserve.cluster.registry import Instance


def _instance(name: str) -> Instance:
    return Instance(name, "chat", "prefill", f"{name}:80", f"{name}:90")


def _sorted_reference(candidates: list[Instance], load: Counter[str]) -> list[Instance]:
    return sorted(candidates, key=lambda i: (load[i.instance_id], i.instance_id))


def test_least_busy_first_matches_the_full_sort_on_random_groups():
    rng = random.Random(7)
    for _ in range(300):
        names = [f"p{rng.randrange(40)}" for _ in range(rng.randrange(0, 30))]
        candidates = [_instance(n) for n in names]  # unordered, repeats included
        load = Counter({n: rng.randrange(4) for n in names if rng.random() < 0.7})
        order = list(order_prefill(candidates, "on-demand", load, rng.randrange(9)))
        assert [id(i) for i in order] == [id(i) for i in _sorted_reference(candidates, load)]


def test_the_loads_are_read_when_the_order_is_made():
    candidates = [_instance("a"), _instance("b"), _instance("c")]
    load = Counter({"a": 1})
    order = order_prefill(candidates, "least-connections", load, 0)
    assert next(order).instance_id == "b"
    load["c"] = 5  # an offer in flight meanwhile changes nothing already ordered
    assert [i.instance_id for i in order] == ["c", "a"]


def test_round_robin_rotates_by_turn():
    candidates = [_instance(n) for n in "abc"]
    order = order_prefill(candidates, "round-robin", Counter(), 4)
    assert [i.instance_id for i in order] == ["b", "c", "a"]
    assert list(order_prefill([], "round-robin", Counter(), 4)) == []
