"""P/D roles under tensor parallelism, at the engine level: a prefill instance and a decode
instance of any group sizes (2 -> 1, 1 -> 2, 2 -> 2; chunked, and a multiplexing 2 -> 2)
hand each prompt's KV over real TCP and give the greedy tokens of one TP=1 engine doing
everything, with chunked prefill on the prefill side; with one KV head on two ranks too.
The hand-off protocol (abort while waiting, late KV dropped, a first token that ends the
request) holds between groups, and a buffer of the wrong shape fails only its request.

Engines are built once per module and shared: each group of two starts a worker process.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM
from pdserve.handoff import KVHandoff
from pdserve.model.arch import PRESETS
from pdserve.transfer import TcpKVSender
from tests.engine.test_kv_handoff import (
    GREEDY,
    MAX_NEW,
    _decode_all,
    _drain,
    _prefill_all,
    _prompts,
)
from tests.engine.test_kv_handoff import (
    test_abort_while_waiting_for_kv_and_late_kv_is_dropped as check_abort_and_late_kv,
)
from tests.engine.test_kv_handoff import (
    test_first_token_that_ends_the_request_needs_no_kv as check_first_token_ends,
)
from tests.parallel.conftest import hf_greedy
from tests.parallel.test_tensor_parallel import _prompts as vocab_prompts

# chunk_size 24: the longer prompts below prefill in several pieces on the prefill side.
OPTIONS = {"dtype": "float32", "block_size": 8, "schedule": "chunked", "chunk_size": 24,
           "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """Engines by (role, group size[, checkpoint, schedule]), built on first use."""
    built = {}

    def get(role: str, size: int, folder: str = tiny_ckpt, schedule: str = "chunked"):
        key = role, size, folder, schedule
        if key not in built:
            blocks = {"num_blocks": 64} if role == "decode" else {}
            built[key] = LLM(folder, tensor_parallel_size=size, kv_transfer_port=0,
                             **{**OPTIONS, "schedule": schedule}, **blocks).engine
        return built[key]

    yield get
    for engine in built.values():
        engine.close()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    chosen = _prompts(6, seed=5)
    assert max(map(len, chosen)) > OPTIONS["chunk_size"], "some prefill must be chunked"
    return chosen


@pytest.fixture(scope="module")
def single(tiny_ckpt, prompts) -> list[list[int]]:
    llm = LLM(tiny_ckpt, **OPTIONS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("prefill_size, decode_size, schedule", [
    (2, 1, "chunked"), (1, 2, "chunked"), (2, 2, "chunked"), (2, 2, "multiplex")])
def test_pair_of_any_group_sizes_equals_one_engine(engines, tiny_ckpt, prompts, single,
                                                   prefill_size, decode_size, schedule):
    prefill = engines("prefill", prefill_size, tiny_ckpt, schedule)
    decode = engines("decode", decode_size, tiny_ckpt, schedule)
    assert prefill.describe()["tensor_parallel_size"] == prefill_size
    assert decode.describe()["tensor_parallel_size"] == decode_size
    got = _decode_all(decode, prompts, _prefill_all(prefill, decode, prompts))
    assert [got["tokens"][f"r{i}"] for i in range(len(prompts))] == single
    assert set(got["finish"].values()) == {"length"}
    assert decode.blocks.num_free_blocks == decode.blocks.num_blocks
    assert prefill.blocks.num_free_blocks == prefill.blocks.num_blocks


@pytest.mark.slow
def test_replicated_kv_heads_travel_once_and_are_replicated_on_arrival(engines, mqa_ckpt):
    """One KV head on two ranks: the sender keeps one replica, the receiver writes it on
    both; a 2 -> 2 pair and a 1 -> 2 pair give transformers' tokens."""
    folder, hf = mqa_ckpt
    chosen = vocab_prompts(hf.config.vocab_size, count=3)
    want = [hf_greedy(hf, p, MAX_NEW) for p in chosen]
    decode = engines("decode", 2, folder)
    for prefill in (engines("prefill", 2, folder), engines("prefill", 1, folder)):
        got = _decode_all(decode, chosen, _prefill_all(prefill, decode, chosen))
        assert [got["tokens"][f"r{i}"] for i in range(len(chosen))] == want


@pytest.mark.slow
def test_handoff_protocol_holds_between_groups(engines, prompts, single):
    pair = engines("prefill", 2), engines("decode", 2)
    check_abort_and_late_kv(pair)
    check_first_token_ends(pair)
    _check_abort_during_chunked_prefill(*pair)
    # The aborted request's KV was dropped on rank 0 before any rank wrote it: the pair
    # still gives the right tokens.
    got = _decode_all(pair[1], prompts[:2], _prefill_all(*pair, prompts[:2]))
    assert [got["tokens"]["r0"], got["tokens"]["r1"]] == single[:2]


def _check_abort_during_chunked_prefill(prefill, decode) -> None:
    """Aborted between two chunks of its prompt: nothing is exported, every rank's pages of
    it are free again (the workers forget it with the next launch)."""
    sent = prefill.stats().kv_transfers
    prefill.add_request("cut", list(range(3, 3 + 3 * OPTIONS["chunk_size"])), GREEDY,
                        handoff=KVHandoff("t-cut", target=decode.kv_address))
    prefill.step()
    assert prefill.requests["cut"].num_computed == OPTIONS["chunk_size"]
    prefill.abort_request("cut")
    assert [u.finish_reason for u in _drain(prefill)] == ["abort"]
    assert prefill.stats().kv_transfers == sent
    assert prefill.blocks.num_free_blocks == prefill.blocks.num_blocks


def _send(address: str, transfer_id: str, buffer: torch.Tensor) -> None:
    sender = TcpKVSender()
    try:
        sender.send(address, transfer_id, buffer)
    finally:
        sender.close()


@pytest.mark.slow
def test_kv_of_another_shape_fails_its_request_not_the_group(engines, prompts, single):
    """A buffer with the wrong KV heads (another model's) is refused before any rank is told
    to write it: that request fails. One of the right shape in another dtype (a float16
    sender) is cut and sent to the worker in its own dtype, then converted on writing. The
    group stays in step and serves the next request."""
    decode = engines("decode", 2)
    kv_shape = (len(decode.runner.kv_caches), 2, 3, PRESETS["tiny"].num_kv_heads,
                PRESETS["tiny"].head_dim)
    for rid, heads, dtype in [("odd", kv_shape[3] + 1, torch.float32),
                              ("half", kv_shape[3], torch.float16)]:
        decode.add_request(rid, [1, 2, 3], GREEDY, handoff=KVHandoff(f"t-{rid}", first_token=4))
        _send(decode.kv_address, f"t-{rid}", torch.randn(*kv_shape[:3], heads, kv_shape[4],
                                                         dtype=dtype))
    finish = {u.request_id: u.finish_reason for u in _drain(decode) if u.finished}
    assert finish == {"odd": "error", "half": "length"}
    got = _decode_all(decode, prompts[:1], _prefill_all(engines("prefill", 2), decode,
                                                         prompts[:1]))
    assert got["tokens"]["r0"] == single[0]
