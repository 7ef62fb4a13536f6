"""One rank's communicators: collectives of the model, and the control channel of the engine.

Each engine builds its own process groups from its own store (no torch.distributed default
group), so several engines can live in one process (tests) and each one's groups end with
it. Collectives run on the communicator of the lane being launched: a decode step and a
prefill piece that run at the same time (multiplex, disagg) each have their own, so their
all-reduces never queue behind each other on one NCCL stream. The control group is always
gloo: the launch plan is a host object, broadcast without touching the GPU.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

LANES = ("decode", "prefill")
# How long a rank waits in a collective before failing: past any launch, short enough that
# a wedged peer becomes an error rather than a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


class TPComm:
    """Rank ``rank`` of ``size``. With ``size == 1`` every collective is the identity."""

    def __init__(self, rank: int = 0, size: int = 1, lanes: dict | None = None,
                 control=None) -> None:
        self.rank, self.size = rank, size
        self._lanes = lanes or {}
        self._control = control
        self.lane = LANES[0]

    @classmethod
    def connect(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> TPComm:
        """Joins the group: one model communicator per lane (NCCL on a GPU, gloo on the
        CPU) and a gloo control group."""
        lanes = {lane: _group(store, lane, rank, size, device) for lane in LANES}
        control = _group(store, "control", rank, size, torch.device("cpu"))
        if device.type == "cuda":
            _warm_up(lanes.values(), device)
        return cls(rank, size, lanes, control)

    @contextmanager
    def on_lane(self, lane: str) -> Iterator[None]:
        """Collectives issued inside go to ``lane``'s communicator."""
        previous, self.lane = self.lane, lane if lane in LANES else LANES[0]
        try:
            yield
        finally:
            self.lane = previous

    # ---- model collectives ----

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            self._lanes[self.lane].allreduce([x]).wait()
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on every rank -> [N, size * C], rank r's columns at [r * C, (r + 1) * C)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._lanes[self.lane].allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    # ---- control ----

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends ``obj`` (pickled: one size, one payload), the others receive it."""
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=5)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._control.broadcast(size, 0).wait()
        if self.rank != 0:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self._control.broadcast(payload, 0).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    def gather_to_first(self, x: torch.Tensor, empty=None) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (a CPU tensor of one shape on all ranks), in rank order, on
        rank 0 (its own is ``x`` itself); None elsewhere. ``empty(shape, dtype)`` allocates
        what rank 0 receives into.

        Point-to-point, not gloo's ``gather``: that one receives into a scratch buffer it
        allocates per call and copies out, measured 4-8x slower for 64 MiB on the CPU host
        (fresh memory is faulted in page by page; ``recv`` writes straight into ``empty``'s
        memory, which ``host_empty`` keeps faulted in). Raw bytes: gloo need not know the
        dtype."""
        if self.rank != 0:
            self._control.send([_bytes(x)], 0, 0).wait()
            return None
        empty = empty or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        parts = [x]
        for rank in range(1, self.size):
            part = empty(tuple(x.shape), x.dtype)
            self._control.recv([_bytes(part)], rank, 0).wait()
            parts.append(part)
        return parts

    def scatter_from_first(self, pieces: list[torch.Tensor] | None,
                           out: torch.Tensor) -> torch.Tensor:
        """Rank r > 0 receives ``pieces[r]`` (given on rank 0, CPU tensors of ``out``'s shape
        and dtype) into ``out``; rank 0 gets ``pieces[0]`` back."""
        if self.rank != 0:
            self._control.recv([_bytes(out)], 0, 0).wait()
            return out
        for rank in range(1, self.size):
            self._control.send([_bytes(pieces[rank])], rank, 0).wait()
        return pieces[0]

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank holds (KV pages every rank can fit)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        self._control.allreduce(tensor, op=dist.ReduceOp.MIN).wait()
        return int(tensor)


SINGLE = TPComm()


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's memory as bytes (a view: a receive writes into ``x``)."""
    if not x.is_contiguous():
        raise ValueError("point-to-point transfers need contiguous tensors")
    return x.reshape(-1).view(torch.uint8)


def _warm_up(groups, device: torch.device) -> None:
    """NCCL makes a communicator on its first collective: make it now, not inside a CUDA
    graph capture, where creating one is not allowed."""
    probe = torch.ones(1, device=device)
    for group in groups:
        group.allreduce([probe]).wait()
    torch.cuda.synchronize(device)


def _group(store: dist.Store, name: str, rank: int, size: int, device: torch.device):
    prefixed = dist.PrefixStore(name, store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = name == "decode"
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, COLLECTIVE_TIMEOUT)
