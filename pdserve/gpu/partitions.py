"""SM partitions for PD-multiplexing: decode on one slice of the SMs, prefill on the rest.

A ``PartitionSet`` is built once at start-up: one split per decode size the planner may
pick, plus the whole GPU (ordinary streams, time-shared) for mixed batches and for
either phase alone. Decode CUDA graphs must be captured per partition on its own
``decode_stream``: a graph keeps the SM limit of the stream it was captured on.

Partitions of different splits share SMs, so switching from one to another is safe only
once the work issued under the old one has drained; that is the engine's duty.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.gpu.driver import EmulatedDriver, SmDriver, create_driver

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Partition:
    """Decode gets ``decode_sms``, prefill ``prefill_sms``; streams are None when emulated.

    On the whole GPU both counts are the device's SM count and both streams are the same
    ordinary stream: the phases time-share every SM.
    """

    decode_sms: int
    prefill_sms: int
    decode_stream: Any = field(default=None, compare=False, repr=False)
    prefill_stream: Any = field(default=None, compare=False, repr=False)
    whole_gpu: bool = False
    emulated: bool = False


class PartitionSet:
    """The partitions the planner can choose from, keyed by their (actual) decode SMs."""

    def __init__(self, partitions: Iterable[Partition], whole_gpu: Partition, total_sms: int,
                 granularity: int, emulated: bool):
        self._by_decode = {p.decode_sms: p for p in sorted(partitions, key=_decode_sms)}
        self.whole_gpu = whole_gpu
        self.total_sms = total_sms
        self.granularity = granularity
        self.emulated = emulated
        self.emulation_reason = "emulated partitions" if emulated else None

    @classmethod
    def build(cls, driver: SmDriver, decode_sm_options: Iterable[int] | None = None,
              min_prefill_sms: int | None = None) -> PartitionSet:
        """One split per decode size; sizes the driver rounds to the same split are merged.

        ``decode_sm_options`` defaults to every size the driver allows, from its minimum
        partition in steps of its granularity, while prefill keeps at least
        ``min_prefill_sms`` (default: the minimum partition).
        """
        total, step = driver.total_sms(), driver.granularity()
        smallest = driver.min_partition_sms()
        floor = smallest if min_prefill_sms is None else min_prefill_sms
        asked = sorted(set(decode_sm_options or range(smallest, total, step)))
        partitions: dict[int, Partition] = {}
        for decode_sms in asked:
            part = _carve(driver, decode_sms, floor)
            if part is not None and part.decode_sms not in partitions:
                partitions[part.decode_sms] = part
        ordinary = driver.ordinary_stream()
        whole = Partition(total, total, ordinary, ordinary, whole_gpu=True,
                          emulated=driver.emulated)
        return cls(partitions.values(), whole, total, step, driver.emulated)

    @classmethod
    def for_device(cls, device: str | int | None = None,
                   decode_sm_options: Iterable[int] | None = None) -> PartitionSet:
        """Real partitions where green contexts work, emulated ones elsewhere (logged)."""
        driver = create_driver(device)
        try:
            pset = cls.build(driver, decode_sm_options)
        except Exception as exc:  # a driver that splits but cannot make green streams
            if driver.emulated:
                raise
            logger.warning("SM partitions emulated (building green contexts failed: %s)", exc)
            nominal = EmulatedDriver(num_sms=driver.total_sms(), granule=driver.granularity())
            pset = cls.build(nominal, decode_sm_options)
            pset.emulation_reason = f"building green contexts failed: {exc}"
            return pset
        if driver.emulated:
            pset.emulation_reason = getattr(driver, "reason", "") or "no green-context driver"
        return pset

    def choices(self) -> list[Partition]:
        """Spatial partitions, fewest decode SMs first (the whole GPU is ``whole_gpu``)."""
        return list(self._by_decode.values())

    def decode_sm_choices(self) -> list[tuple[int, int]]:
        """(decode SMs, prefill SMs) of each spatial partition: what the planner needs."""
        return [(p.decode_sms, p.prefill_sms) for p in self._by_decode.values()]

    def get(self, decode_sms: int) -> Partition:
        """The partition with exactly these decode SMs; the device's SM count is the whole GPU."""
        if decode_sms == self.total_sms:
            return self.whole_gpu
        try:
            return self._by_decode[decode_sms]
        except KeyError:
            raise KeyError(f"no partition with {decode_sms} decode SMs; "
                           f"choices: {list(self._by_decode)}") from None

    def describe(self) -> dict:
        return {"kind": "emulated" if self.emulated else "green contexts",
                "emulation_reason": self.emulation_reason, "total_sms": self.total_sms,
                "splits": self.decode_sm_choices()}

    def __len__(self) -> int:
        return len(self._by_decode)

    def __repr__(self) -> str:
        kind = "emulated" if self.emulated else "green contexts"
        return f"PartitionSet({kind}, {self.total_sms} SMs, decode {list(self._by_decode)})"


def _carve(driver: SmDriver, decode_sms: int, min_prefill_sms: int) -> Partition | None:
    try:
        split = driver.split(decode_sms)
    except Exception as exc:
        logger.debug("split of %d decode SMs refused: %s", decode_sms, exc)
        return None
    if split.decode_sms <= 0 or split.rest_sms < max(min_prefill_sms, 1):
        return None
    return Partition(split.decode_sms, split.rest_sms,
                     driver.make_stream(split.decode_resource),
                     driver.make_stream(split.rest_resource),
                     emulated=driver.emulated)


def _decode_sms(partition: Partition) -> int:
    return partition.decode_sms
