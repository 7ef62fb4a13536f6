from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    """One torch thread here and in every process the tests start (servers, engines, workers,
    which inherit the environment), unless OMP_NUM_THREADS is set already. The suite runs
    several such processes at once: with torch's default pool of one thread per core, they
    oversubscribe a small host and each step of the tiny model can stall for seconds (a
    structured-output request took 10-40 s instead of 0.4-1.4 s on a busy 2-core host; the
    soak in docs/reliability.md saw the same)."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines from one GPU test must not squeeze the KV pool of the next."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
