from __future__ import annotations

import logging

import pytest

from pdserve.gpu import partitions as partitions_module
from pdserve.gpu.driver import EmulatedDriver, FakeDriver, create_driver
from pdserve.gpu.partitions import PartitionSet


def test_halves_never_overlap_and_cover_the_gpu():
    pset = PartitionSet.build(FakeDriver())
    for part in pset.choices():
        decode, prefill = part.decode_stream.sm_ids, part.prefill_stream.sm_ids
        assert not decode & prefill
        assert len(decode | prefill) == pset.total_sms == 132
        assert (len(decode), len(prefill)) == (part.decode_sms, part.prefill_sms)


def test_enumerates_every_split_at_the_driver_granularity():
    pset = PartitionSet.build(FakeDriver())
    # 128 would leave 4 SMs, below the minimum partition: not offered.
    assert [p.decode_sms for p in pset.choices()] == list(range(8, 128, 8))
    assert pset.decode_sm_choices()[0] == (8, 124)
    assert pset.granularity == 8 and not pset.emulated


def test_counts_round_up_like_the_driver():
    driver = FakeDriver()
    pset = PartitionSet.build(driver, decode_sm_options=[66, 100, 70, 72])
    assert [p.decode_sms for p in pset.choices()] == [72, 104]  # 66, 70, 72 -> one split
    assert pset.get(72).prefill_sms == 60
    assert driver.split_calls == [66, 70, 72, 100]
    with pytest.raises(KeyError):
        pset.get(66)


def test_granularity_is_asked_from_the_driver():
    pset = PartitionSet.build(FakeDriver(num_sms=20, granule=2, min_sms=4))
    assert [p.decode_sms for p in pset.choices()] == [4, 6, 8, 10, 12, 14, 16]


def test_whole_gpu_uses_one_ordinary_stream():
    pset = PartitionSet.build(FakeDriver())
    whole = pset.whole_gpu
    assert whole.whole_gpu and pset.get(132) is whole
    assert whole.decode_sms == whole.prefill_sms == 132
    assert whole.decode_stream is whole.prefill_stream
    assert whole.decode_stream.sm_ids is None


def test_cpu_falls_back_to_emulated_partitions(caplog):
    with caplog.at_level(logging.WARNING):
        pset = PartitionSet.for_device("cpu")
    assert pset.emulated and len(pset) > 0
    assert all(p.decode_stream is None and p.prefill_stream is None for p in pset.choices())
    assert all(p.decode_sms + p.prefill_sms == pset.total_sms for p in pset.choices())
    assert len([r for r in caplog.records if "emulated" in r.getMessage()]) == 1


def test_failing_green_streams_fall_back_to_emulated(monkeypatch, caplog):
    class BrokenDriver(FakeDriver):
        def make_stream(self, resource):
            raise RuntimeError("cuGreenCtxCreate failed")

    monkeypatch.setattr(partitions_module, "create_driver", lambda device: BrokenDriver())
    with caplog.at_level(logging.WARNING):
        pset = PartitionSet.for_device("cuda")
    assert pset.emulated and pset.total_sms == 132
    assert "emulated" in caplog.text


def test_create_driver_on_cpu_is_emulated():
    driver = create_driver("cpu")
    assert isinstance(driver, EmulatedDriver) and driver.emulated
    assert driver.split(66).decode_sms == 72


@pytest.mark.gpu
def test_real_partitions_limit_a_gemm():
    import torch

    pset = PartitionSet.for_device("cuda")
    if pset.emulated:
        pytest.skip("green contexts unavailable on this GPU")
    small, big = pset.choices()[0], pset.choices()[-1]
    assert small.decode_sms + small.prefill_sms <= pset.total_sms
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gemm_ms(stream) -> float:
        with torch.cuda.stream(stream):
            a @ a  # warm-up (cuBLAS handle, workspace) on this stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(5):
                a @ a
            end.record(stream)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 5

    # The small partition's decode half has the fewest SMs, the big one's the most.
    assert gemm_ms(small.decode_stream) > 1.5 * gemm_ms(big.decode_stream)
