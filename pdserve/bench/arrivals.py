"""Arrival processes: when each request of an open-loop run is sent.

Inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean ``1 / rate``
(the convention of ``vllm bench serve``): burstiness 1 is a Poisson process, below 1 is
burstier, above 1 smoother (a very large value is close to a fixed interval).
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.bench.workloads import BenchError


def gamma_arrivals(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds; the first request is sent at 0. ``rate=inf``: all at 0."""
    if num <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise BenchError("rate and burstiness must be > 0")
    rng = np.random.default_rng([seed, 4])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return [0.0] + np.cumsum(gaps).tolist()
