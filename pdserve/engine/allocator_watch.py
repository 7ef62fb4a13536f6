"""CUDA memory the caching allocator took from the driver after start-up.

An eager step larger than any the start-up ran needs activation blocks the caching
allocator does not hold yet: it then calls ``cudaMalloc`` inside the step, and on a GPU
whose KV pool leaves little free memory it may first free its cached blocks and retry,
which waits for the device. Both stall the step that met them, the way a kernel compiled
on first use does (``compile_watch.py``). On the H200 fresh multiplex servers ran their
first eager mixed steps at 1.3-2.1x their prediction with no kernel compiled: this watch
says whether the allocator grew meanwhile, so the next run can tell that cause from the
others.
"""

from __future__ import annotations

import torch

# torch.cuda.memory_stats keys: segments obtained from cudaMalloc, allocation retries after
# freeing the cache, bytes reserved from the driver.
SEGMENTS, RETRIES, RESERVED = ("segment.all.allocated", "num_alloc_retries",
                               "reserved_bytes.all.current")


class AllocatorWatch:
    """The allocator's counters when ``serving()`` was called, against now (a CUDA device
    only: elsewhere there is no caching allocator to watch, and ``describe`` says so)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start: dict[str, int] | None = None

    def serving(self) -> None:
        if self.device.type == "cuda":
            self._start = self._counters()

    def _counters(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.device)
        return {key: int(stats.get(key, 0)) for key in (SEGMENTS, RETRIES, RESERVED)}

    def segments(self) -> int:
        """Segments allocated from the driver so far (a CUDA device only): read around a
        launch, their difference is the cudaMallocs it made."""
        # The nested form: memory_stats() flattens and sorts every counter, twice a launch.
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        return int(stats.get("segment", {}).get("all", {}).get("allocated", 0))

    def describe(self) -> dict:
        if self.device.type != "cuda":
            return {"watched": False, "why": f"no caching CUDA allocator on {self.device.type}"}
        if self._start is None:
            return {"watched": False, "why": "not serving yet"}
        now = self._counters()
        return {"watched": True,
                "cuda_mallocs": now[SEGMENTS] - self._start[SEGMENTS],
                "alloc_retries": now[RETRIES] - self._start[RETRIES],
                "reserved_growth_mib": round((now[RESERVED] - self._start[RESERVED]) / 2**20, 1)}

