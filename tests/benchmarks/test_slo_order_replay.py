"""benchmarks/slo_order_replay.py: the queue model on arrivals whose answer is known."""

from __future__ import annotations

from test_scripts import _load


def test_the_slo_order_meets_two_deadlines_where_fcfs_meets_one():
    replay = _load("slo_order_replay").replay
    # While a 1 s prompt runs, a 4 s one and two 1 s ones queue up; the SLO is 5.5 s.
    arrivals, services = [0.0, 0.05, 0.1, 0.2], [1.0, 4.0, 1.0, 1.0]
    assert replay(arrivals, services, 5.5, "fcfs") == 2
    assert replay(arrivals, services, 5.5, "slo") == 3


def test_both_orders_meet_every_deadline_of_an_idle_server():
    replay = _load("slo_order_replay").replay
    arrivals, services = [0.0, 10.0, 20.0], [3.0, 3.0, 3.0]
    assert replay(arrivals, services, 4.0, "fcfs") == replay(arrivals, services, 4.0, "slo") == 3
