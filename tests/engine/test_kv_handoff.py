"""P/D across instances at the engine level: a prefill engine ships each prompt's KV over a
real TCP socket to a decode engine, which continues from the second token. Greedy tokens must
equal one engine doing both."""

from __future__ import annotations

import random
import socket
import time

import pytest
import torch
import xxhash

from pdserve import LLM, SamplingParams
from pdserve.engine.core import EngineCore
from pdserve.handoff import HANDOFF_FINISH_REASON, KVHandoff
from pdserve.sampling_params import InvalidRequestError
from pdserve.transfer import tcp
from pdserve.transfer.transport import KVLayout

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
OPTIONS = {"dtype": "float32", "block_size": 8, "chunk_size": 48}


def _engine(**options) -> EngineCore:
    return LLM("tiny", kv_transfer_port=0, **{**OPTIONS, **options}).engine


@pytest.fixture(scope="module")
def pair():
    prefill, decode = _engine(), _engine(num_blocks=64)
    yield prefill, decode
    prefill.close()
    decode.close()


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(24)]  # prefix hits on the prefill side
    return [(shared if i % 2 else []) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 70))]
            for i in range(count)]


def _drain(engine: EngineCore, timeout: float = 60) -> list:
    updates, deadline = [], time.monotonic() + timeout
    while engine.has_work():
        assert time.monotonic() < deadline, "engine did not finish"
        updates += engine.step()
    return updates


def _prefill_all(prefill: EngineCore, decode: EngineCore, prompts, params=GREEDY) -> dict:
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params,
                            handoff=KVHandoff(f"t{i}", target=decode.kv_address))
    first = {u.request_id: u for u in _drain(prefill) if u.new_token_ids}
    prefill.check_integrity()
    return first


def _decode_all(decode: EngineCore, prompts, first: dict, params=GREEDY) -> dict:
    for i, prompt in enumerate(prompts):
        token = first[f"r{i}"].new_token_ids[0]
        decode.add_request(f"r{i}", prompt, params,
                           handoff=KVHandoff(f"t{i}", first_token=token))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finish = {}
    for update in _drain(decode):
        tokens[update.request_id] += update.new_token_ids
        if update.finished:
            finish[update.request_id] = update.finish_reason
    decode.check_integrity()
    return {"tokens": tokens, "finish": finish}


def test_split_prefill_and_decode_match_one_engine(pair):
    prefill, decode = pair
    prompts = _prompts(6)
    single = LLM("tiny", **OPTIONS).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    first = _prefill_all(prefill, decode, prompts)
    assert {u.finish_reason for u in first.values()} == {HANDOFF_FINISH_REASON}
    got = _decode_all(decode, prompts, first)
    assert [got["tokens"][f"r{i}"] for i in range(len(prompts))] == \
        [o.outputs[0].token_ids for o in single]
    assert set(got["finish"].values()) == {"length"}
    assert decode.blocks.num_free_blocks == decode.blocks.num_blocks
    assert decode.kv.receiver.pending() == 0
    assert prefill.stats().kv_transfers == len(prompts)


def test_decode_pool_too_small_waits_instead_of_failing(pair):
    prefill, _ = pair
    small = _engine(num_blocks=14)  # ~2 of these requests at a time
    try:
        prompts = [[5 + i] * 40 for i in range(5)]
        first = _prefill_all(prefill, small, prompts)
        got = _decode_all(small, prompts, first)
        assert set(got["finish"].values()) == {"length"}
        assert all(len(t) == MAX_NEW for t in got["tokens"].values())
    finally:
        small.close()


def test_first_token_that_ends_the_request_needs_no_kv(pair):
    prefill, decode = pair
    one = SamplingParams(max_tokens=1, temperature=0)
    prompt = [7, 8, 9]
    prefill.add_request("solo", prompt, one, handoff=KVHandoff("ts", target=decode.kv_address))
    (update,) = [u for u in _drain(prefill) if u.request_id == "solo"]
    assert update.finish_reason == "length"  # finished for real: nothing to hand off
    decode.add_request("solo", prompt, one,
                       handoff=KVHandoff("ts", first_token=update.new_token_ids[0]))
    (done,) = decode.step()
    assert done.finished and done.finish_reason == "length"
    assert not decode.has_work()


def test_abort_while_waiting_for_kv_and_late_kv_is_dropped(pair):
    prefill, decode = pair
    received = decode.kv.receiver.stats
    before = received.num_transfers
    decode.add_request("late", [1, 2, 3, 4], GREEDY, handoff=KVHandoff("tl", first_token=5))
    assert decode.step()[0].new_token_ids == [5]  # the first token goes out at once
    decode.abort_request("late")
    (aborted,) = decode.step()
    assert aborted.finish_reason == "abort" and not decode.has_work()
    prefill.add_request("late", [1, 2, 3, 4], GREEDY,
                        handoff=KVHandoff("tl", target=decode.kv_address))
    _drain(prefill)
    deadline = time.monotonic() + 5
    while received.num_transfers == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received.num_transfers == before + 1  # it did arrive...
    assert decode.kv.receiver.pending() == 0  # ...and was dropped, not kept


def test_kv_that_never_arrives_fails_only_that_request():
    decode = _engine(kv_transfer_timeout=0.2)
    try:
        decode.add_request("lost", [1, 2, 3], GREEDY, handoff=KVHandoff("tx", first_token=4))
        decode.add_request("fine", [1, 2, 3], GREEDY)
        finish = {u.request_id: u.finish_reason for u in _drain(decode) if u.finished}
        assert finish == {"lost": "error", "fine": "length"}
        decode.check_integrity()
    finally:
        decode.close()


def test_corrupt_kv_fails_its_request_at_once_not_at_the_timeout():
    """A buffer whose digest does not match is dropped by the receiver, and the engine fails
    the request awaiting it on the next step; with a 600 s timeout, waiting for it would hang
    the drain below."""
    decode = _engine(kv_transfer_timeout=600)
    try:
        decode.add_request("bad", [1, 2, 3], GREEDY, handoff=KVHandoff("tc", first_token=4))
        decode.add_request("fine", [1, 2, 3], GREEDY)
        _send_corrupt(decode.kv_address, "tc")
        finish = {u.request_id: u.finish_reason for u in _drain(decode) if u.finished}
        assert finish == {"bad": "error", "fine": "length"}
        assert decode.kv.receiver.stats.num_corrupt == 1
        decode.check_integrity()
        assert decode.blocks.num_free_blocks == decode.blocks.num_blocks
    finally:
        decode.close()


def _send_corrupt(address: str, transfer_id: str) -> None:
    """One KV message on the wire with a digest that does not match its bytes."""
    payload = torch.randn(2, 2, 3, 2, 8)
    header = tcp.encode_header(transfer_id, KVLayout.of(payload))
    digest = tcp.DIGEST.pack(xxhash.xxh3_64_intdigest(payload.numpy().tobytes()) ^ 1)
    with socket.create_connection(tcp.split_address(address)) as sock:
        sock.sendall(header + payload.numpy().tobytes() + digest)


@pytest.mark.parametrize("handoff, match", [
    (KVHandoff("x"), "either a target"),
    (KVHandoff("x", target="h:1", first_token=3), "either a target"),
    (KVHandoff("x", first_token=10**9), "vocabulary"),
])
def test_bad_handoff_is_refused(pair, handoff, match):
    with pytest.raises(InvalidRequestError, match=match):
        pair[1].add_request("bad", [1, 2], GREEDY, handoff=handoff)


def test_instance_without_kv_transfer_refuses_handoff():
    engine = LLM("tiny", **OPTIONS).engine
    with pytest.raises(InvalidRequestError, match="--kv-transfer-port"):
        engine.add_request("r", [1, 2], GREEDY, handoff=KVHandoff("t", first_token=3))


@pytest.mark.parametrize("prefill_schedule,decode_schedule", [
    ("multiplex", "multiplex"), ("multiplex", "chunked"), ("prefill-first", "multiplex")])
def test_multiplex_serves_both_roles(prefill_schedule, decode_schedule):
    """A multiplexing instance exports KV after its final prefill piece and takes KV in as
    an ordinary decode; any pairing gives the tokens of one engine doing everything."""
    prompts = _prompts(5, seed=4)
    single = LLM("tiny", **OPTIONS).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    prefill = _engine(schedule=prefill_schedule, max_num_batched_tokens=64)
    decode = _engine(schedule=decode_schedule, max_num_batched_tokens=64, num_blocks=64)
    try:
        got = _decode_all(decode, prompts, _prefill_all(prefill, decode, prompts))
        assert [got["tokens"][f"r{i}"] for i in range(len(prompts))] == \
            [o.outputs[0].token_ids for o in single]
        assert decode.blocks.num_free_blocks == decode.blocks.num_blocks
        assert prefill.blocks.num_free_blocks == prefill.blocks.num_blocks
    finally:
        prefill.close()
        decode.close()


def test_disagg_refuses_a_pd_role_before_loading():
    with pytest.raises(ValueError, match="cannot serve a P/D role"):
        _engine(schedule="disagg")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["chunked", "multiplex"])
def test_split_on_gpu_matches_one_engine(hf_llama_gpu, schedule):
    """Device pools: the export's pinned copy and event, the scatter from host memory."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    folder, _ = hf_llama_gpu
    common = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=16,
                  num_blocks=2048, chunk_size=256)  # explicit pools: three engines share it
    prompts = [p * 4 for p in _prompts(8, seed=3)]
    single = LLM(folder, **common).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    role = dict(common, schedule=schedule, max_num_batched_tokens=256, mux_predictor="roofline")
    prefill = LLM(folder, kv_transfer_port=0, **role).engine
    decode = LLM(folder, kv_transfer_port=0, **role).engine
    try:
        got = _decode_all(decode, prompts, _prefill_all(prefill, decode, prompts))
        assert [got["tokens"][f"r{i}"] for i in range(len(prompts))] == \
            [o.outputs[0].token_ids for o in single]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("handoff", [KVHandoff("p", target="127.0.0.1:1"),
                                     KVHandoff("d", first_token=3)])
def test_prompt_logprobs_are_refused_on_a_hand_off(pair, handoff):
    # The prefill instance scores the prompt but nothing carries the scores to the client.
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        pair[0].add_request("scored", [1, 2, 3], params, handoff=handoff)
