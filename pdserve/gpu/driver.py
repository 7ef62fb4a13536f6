"""SM drivers: who carves the GPU's SMs into green-context halves and makes streams on them.

Three implementations of one small protocol:

- ``CudaDriver``: the real one, over ``cuda.bindings.driver`` (green contexts).
- ``FakeDriver``: a pure-Python stand-in with real rounding rules, for tests.
- ``EmulatedDriver``: nominal SM counts and no streams, so the multiplex scheduler runs
  unchanged where green contexts are unavailable (CPU, old driver, missing bindings).

Both halves of a partition always come from ONE split call: separate green-context
creations may hand out overlapping SMs (PyTorch issue 195378).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

logger = logging.getLogger(__name__)


class SmSplit(NamedTuple):
    """One split of the device: the decode half and the rest, with the counts the driver gave."""

    decode_resource: Any
    rest_resource: Any
    decode_sms: int
    rest_sms: int


class SmDriver(Protocol):
    name: str
    emulated: bool

    def total_sms(self) -> int: ...

    def min_partition_sms(self) -> int: ...

    def granularity(self) -> int: ...

    def split(self, decode_sms: int) -> SmSplit: ...

    def make_stream(self, resource: Any) -> Any: ...

    def ordinary_stream(self) -> Any: ...


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# --------------------------------------------------------------------------- fake


@dataclass(frozen=True)
class FakeStream:
    """What FakeDriver hands out for a stream: it remembers the SMs it may use."""

    sm_ids: frozenset[int] | None


@dataclass
class FakeDriver:
    """Pure-Python driver with the driver's rounding rule: counts round up to ``granularity``.

    Resources are frozensets of SM ids, so tests can check that two halves never overlap.
    """

    num_sms: int = 132
    granule: int = 8
    min_sms: int | None = None
    name: str = "fake"
    emulated: bool = False
    split_calls: list[int] = field(default_factory=list)

    def total_sms(self) -> int:
        return self.num_sms

    def min_partition_sms(self) -> int:
        return self.min_sms or self.granule

    def granularity(self) -> int:
        return self.granule

    def split(self, decode_sms: int) -> SmSplit:
        self.split_calls.append(decode_sms)
        got = round_up(max(decode_sms, self.min_partition_sms()), self.granule)
        if got > self.num_sms:
            raise ValueError(f"asked {decode_sms} SMs of {self.num_sms}")
        decode, rest = frozenset(range(got)), frozenset(range(got, self.num_sms))
        return SmSplit(decode, rest, len(decode), len(rest))

    def make_stream(self, resource: Any) -> FakeStream:
        return FakeStream(resource)

    def ordinary_stream(self) -> FakeStream:
        return FakeStream(None)


# ----------------------------------------------------------------------- emulated


@dataclass
class EmulatedDriver:
    """No SM isolation: nominal counts only, streams are None (the caller's current stream)."""

    num_sms: int = 132
    granule: int = 8
    name: str = "emulated"
    emulated: bool = True

    def total_sms(self) -> int:
        return self.num_sms

    def min_partition_sms(self) -> int:
        return self.granule

    def granularity(self) -> int:
        return self.granule

    def split(self, decode_sms: int) -> SmSplit:
        got = min(round_up(max(decode_sms, self.granule), self.granule), self.num_sms)
        return SmSplit(None, None, got, self.num_sms - got)

    def make_stream(self, resource: Any) -> None:
        return None

    def ordinary_stream(self) -> None:
        return None


# --------------------------------------------------------------------------- cuda


class CudaError(RuntimeError):
    pass


def _check(result: tuple) -> Any:
    """cuda.bindings returns (CUresult, *values): raise on error, unwrap the values."""
    from cuda.bindings import driver as drv

    err, *values = result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaError(str(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class CudaDriver:
    """Green contexts through ``cuda.bindings.driver`` on one device.

    The SM split rules (minimum partition, step) are read from the device's SM resource
    (``minSmPartitionSize``, ``smCoscheduledAlignment``) and confirmed by dry splits, since
    older bindings lack those fields and the driver, not us, decides the rounding.
    """

    name = "cuda"
    emulated = False

    def __init__(self, device_index: int = 0):
        import torch
        from cuda.bindings import driver as drv

        self._drv = drv
        self._torch = torch
        self.device_index = device_index
        torch.cuda.init()
        # Make torch's primary context current before any green context exists.
        torch.zeros(1, device=f"cuda:{device_index}")
        _check(drv.cuInit(0))
        self._device = _check(drv.cuDeviceGet(device_index))
        self._resource = _check(drv.cuDeviceGetDevResource(
            self._device, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        self._keepalive: list[Any] = []  # green contexts and raw streams live as long as we do
        self._min, self._step = self._discover_split_rule()

    def total_sms(self) -> int:
        return int(self._resource.sm.smCount)

    def min_partition_sms(self) -> int:
        return self._min

    def granularity(self) -> int:
        return self._step

    def split(self, decode_sms: int) -> SmSplit:
        err, groups, num_groups, rest = self._drv.cuDevSmResourceSplitByCount(
            1, self._resource, 0, int(decode_sms))
        if err != self._drv.CUresult.CUDA_SUCCESS or num_groups < 1:
            raise CudaError(f"split of {decode_sms} SMs failed: {err} ({num_groups} groups)")
        decode = groups[0]
        return SmSplit(decode, rest, int(decode.sm.smCount), int(rest.sm.smCount))

    def make_stream(self, resource: Any) -> Any:
        drv = self._drv
        desc = _check(drv.cuDevResourceGenerateDesc([resource], 1))
        gctx = _check(drv.cuGreenCtxCreate(
            desc, self._device, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        raw = self._green_stream(gctx)
        self._keepalive.append((gctx, raw))
        return self._torch.cuda.ExternalStream(int(raw), device=f"cuda:{self.device_index}")

    def ordinary_stream(self) -> Any:
        return self._torch.cuda.Stream(device=f"cuda:{self.device_index}")

    def close(self) -> None:
        """Destroys the streams and green contexts made here (only once no work uses them)."""
        drv = self._drv
        for gctx, raw in reversed(self._keepalive):
            drv.cuStreamDestroy(raw)
            drv.cuGreenCtxDestroy(gctx)
        self._keepalive.clear()

    def _green_stream(self, gctx: Any) -> Any:
        drv = self._drv
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        if hasattr(drv, "cuGreenCtxStreamCreate"):
            return _check(drv.cuGreenCtxStreamCreate(gctx, flags, 0))
        # Drivers before 12.5 lack cuGreenCtxStreamCreate: make the stream inside the
        # green context's own context instead.
        ctx = _check(drv.cuCtxFromGreenCtx(gctx))
        _check(drv.cuCtxPushCurrent(ctx))
        try:
            return _check(drv.cuStreamCreate(flags))
        finally:
            _check(drv.cuCtxPopCurrent())

    def _discover_split_rule(self) -> tuple[int, int]:
        """(minimum SMs of a partition, step between partition sizes)."""
        sm = self._resource.sm
        fields = [int(getattr(sm, name, 0) or 0)
                  for name in ("minSmPartitionSize", "smCoscheduledAlignment")]
        smallest = self._dry_split(1)
        step = self._dry_split(smallest + 1) - smallest if smallest else 0
        if smallest > 0 and step > 0:
            logger.info("SM split rule from dry splits: min %d, step %d (resource fields %s)",
                        smallest, step, fields)
            return smallest, step
        minimum, alignment = fields
        if minimum > 0 or alignment > 0:
            return max(minimum, alignment), max(alignment, 1)
        logger.warning("could not learn the SM split rule; assuming multiples of 8")
        return 8, 8

    def _dry_split(self, asked: int) -> int:
        try:
            return self.split(asked).decode_sms
        except CudaError:
            return 0


# ------------------------------------------------------------------------ factory


def create_driver(device: str | int | None = None) -> SmDriver:
    """The real driver where green contexts work; otherwise an ``EmulatedDriver``.

    ``device`` is "cpu", "cuda", "cuda:N", an index, or None (CUDA when present).
    Logs one line saying which driver is used and, when emulated, why.
    """
    index, reason = _cuda_index(device)
    if index is not None:
        try:
            driver = CudaDriver(index)
            logger.info("green contexts on cuda:%d: %d SMs, partitions of %d + k*%d SMs",
                        index, driver.total_sms(), driver.min_partition_sms(),
                        driver.granularity())
            return driver
        except Exception as exc:  # import errors, old drivers, unsupported devices
            reason = f"green contexts unavailable ({type(exc).__name__}: {exc})"
    emulated = EmulatedDriver(num_sms=_nominal_sms(index))
    emulated.reason = reason
    logger.warning("SM partitions emulated (%s): %d nominal SMs, no isolation",
                   reason, emulated.num_sms)
    return emulated


def _cuda_index(device: str | int | None) -> tuple[int | None, str]:
    try:
        import torch
    except ImportError:
        return None, "torch missing"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    if device is None or device == "cuda":
        return torch.cuda.current_device(), ""
    if isinstance(device, int):
        return device, ""
    if str(device).startswith("cuda:"):
        return int(str(device).split(":", 1)[1]), ""
    return None, f"device {device!r}"


def _nominal_sms(index: int | None) -> int:
    if index is None:
        return 132  # an H200: SM counts on CPU mirror the GPU we plan for
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count
