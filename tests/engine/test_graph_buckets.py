"""Which decode batch sizes multiplexing captures as graphs, per partition."""
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.graph_runner import batch_buckets
from pdserve.engine.model_runner import graph_buckets


def _config(**flags) -> EngineConfig:
    return EngineConfig.from_flat(schedule="multiplex", **flags)


def test_the_whole_gpu_captures_every_16_and_a_split_only_the_listed_sizes():
    config = _config()
    whole, split = graph_buckets(config, whole_gpu=True), graph_buckets(config)
    assert whole == batch_buckets(256) and len(whole) == 20
    assert split == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256]
    assert set(split) <= set(whole)  # a profile taken at the split's sizes is exact on both
    # A batch of 141 replays 144 rows on the whole GPU, not 192.
    assert min(b for b in whole if b >= 141) == 144


@pytest.mark.parametrize("flags, whole, split", [
    ({"max_num_seqs": 100}, batch_buckets(100), [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]),
    ({"mux_graph_batches": "8,64"}, batch_buckets(256), [8, 64, 256]),
    ({"enforce_eager": True}, [], []),
])
def test_the_batch_limit_and_eager_mode_bound_both(flags, whole, split):
    config = _config(**flags)
    assert graph_buckets(config, whole_gpu=True) == whole
    assert graph_buckets(config) == split
