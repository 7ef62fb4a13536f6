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


def _record(sends: list[float], prompts: list[int], rate: float) -> dict:
    samples = [{"success": True, "send_s": send, "prompt_len": prompt, "ttft_ms": 1000.0}
               for send, prompt in zip(sends, prompts, strict=True)]
    return {"probe": {"workload": "w", "config": "c", "rate": rate, "requests": len(sends)},
            "workload": {"definition": {"ttft_slo_ms": 5500.0}}, "samples": samples}


def test_a_given_prefill_rate_and_arrival_rate_rescale_the_queue():
    estimate = _load("slo_order_replay").estimate
    # At 1,000 tokens/s these are the first test's services; sent twice as far apart
    # (probed at 2 req/s, replayed at 1) the queue is the first test's, whose arrivals
    # are 0.05-0.2 s apart.
    record = _record([0.0, 0.025, 0.05, 0.1], [1000, 4000, 1000, 1000], rate=2.0)
    at_probe = estimate(record, 0.9, prefill_rate=1000.0)
    assert at_probe["recorded_ttft_attainment"] == 1.0
    assert (at_probe["model_fcfs_ttft_attainment"], at_probe["model_slo_ttft_attainment"]) == (
        0.5, 0.75)
    # Spread 100x (0.02 req/s) every prompt finds the server idle and both orders meet all.
    spread = estimate(record, 0.9, prefill_rate=1000.0, arrival_rate=0.02)
    assert spread["recorded_ttft_attainment"] is None
    assert spread["model_fcfs_ttft_attainment"] == spread["model_slo_ttft_attainment"] == 1.0
