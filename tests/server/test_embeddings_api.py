"""POST /v1/embeddings through the openai client: one embedding per input, in order, the
offline ``LLM.embed``'s; base64 as OpenAI encodes it; bad input a 400 naming the field."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest

from pdserve import LLM

TEXTS = ["The sky is blue", "a second, longer input with more words in it"]


@pytest.fixture(scope="module")
def offline():
    with LLM("tiny", device="cpu") as llm:
        yield [out.outputs.embedding for out in llm.embed(TEXTS)]


def test_embeddings_are_the_offline_ones_in_order(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    answer = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in answer.data] == [0, 1]
    for got, want in zip(answer.data, offline, strict=True):
        np.testing.assert_allclose(got.embedding, want, atol=1e-5)
        assert np.linalg.norm(got.embedding) == pytest.approx(1.0, abs=1e-5)
    ids = json.loads(server.request("POST", "/tokenize", {"prompt": TEXTS[0]})[2])["tokens"]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens >= len(ids)
    # token ids as input: the same embedding as the text they encode
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, offline[0], atol=1e-5)


def test_base64_is_little_endian_float32(server, offline):
    status, _, raw = server.request("POST", "/v1/embeddings", {
        "model": "tiny", "input": TEXTS[0], "encoding_format": "base64"})
    assert status == 200
    vector = np.frombuffer(base64.b64decode(json.loads(raw)["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, offline[0], atol=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    ids = list(range(5, 45))
    status, _, whole = server.request("POST", "/v1/embeddings", {
        "input": ids[-10:], "encoding_format": "float"})
    status_cut, _, cut = server.request("POST", "/v1/embeddings", {
        "input": ids, "truncate_prompt_tokens": 10})
    assert status == status_cut == 200
    assert json.loads(cut)["usage"]["prompt_tokens"] == 10
    np.testing.assert_allclose(json.loads(cut)["data"][0]["embedding"],
                               json.loads(whole)["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1, -2]}, "input"),
    ({"input": [10**9]}, "input"),  # past the vocabulary
    ({"input": "x " * 5000}, "input"),  # past the context
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "pooling": "mean"}, "pooling"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    status, _, raw = server.request("POST", "/v1/embeddings", body)
    assert status == 400
    assert json.loads(raw)["error"]["param"] == param, raw


def _embed(server, texts: list[str]) -> np.ndarray:
    raw = server.request("POST", "/v1/embeddings", {"input": texts})[2]
    return np.array([d["embedding"] for d in json.loads(raw)["data"]])


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_of_the_embeddings_one_to_many_and_pairwise(server, path):
    texts = ["blue sky", "green grass", "a blue sky today"]
    vectors = _embed(server, texts)
    status, _, raw = server.request("POST", path, {"text_1": texts[0], "text_2": texts[1:]})
    assert status == 200
    answer = json.loads(raw)
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert [d["score"] for d in answer["data"]] == pytest.approx(
        [vectors[0] @ vectors[1], vectors[0] @ vectors[2]], abs=1e-5)
    pairwise = json.loads(server.request("POST", path, {"text_1": texts[:2],
                                                        "text_2": texts[1:]})[2])
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [vectors[0] @ vectors[1], vectors[1] @ vectors[2]], abs=1e-5)
    status, _, raw = server.request("POST", path, {"text_1": texts[:2], "text_2": texts})
    assert status == 400 and json.loads(raw)["error"]["param"] == "text_1"
    # a text that cannot run is named by its field and place
    status, _, raw = server.request("POST", path, {"text_1": "a", "text_2": ["b", "x " * 5000]})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "text_2" and "text_2[1]" in error["message"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_score_and_keeps_the_top_n(server, path):
    query, documents = "blue sky", ["green grass", "a blue sky today", "sky", "stones"]
    vectors = _embed(server, [query, *documents])
    scores = vectors[1:] @ vectors[0]
    order = [int(i) for i in np.argsort(-scores, kind="stable")]
    status, _, raw = server.request("POST", path, {"query": query, "documents": documents,
                                                   "top_n": 2})
    assert status == 200
    results = json.loads(raw)["results"]
    assert [r["index"] for r in results] == order[:2]
    assert [r["relevance_score"] for r in results] == pytest.approx(
        [scores[i] for i in order[:2]], abs=1e-5)
    assert results[0]["document"] == {"text": documents[order[0]]}
    bare = json.loads(server.request("POST", path, {"query": query, "documents": documents,
                                                    "return_documents": False})[2])
    assert len(bare["results"]) == 4 and "document" not in bare["results"][0]
    for body, param in (({"query": "", "documents": ["a"]}, "query"),
                        ({"query": "q", "documents": []}, "documents"),
                        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
                        ({"query": "q", "documents": ["a"], "rank_fields": []}, "rank_fields")):
        status, _, raw = server.request("POST", path, body)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, body


def test_each_input_is_counted_in_the_request_histograms_as_finished(server):
    def counts() -> tuple[float, float, float]:
        m = server.metrics()
        return (m.get('pdserve_requests_finished_total{finish_reason="stop"}', 0),
                m.get("pdserve_e2e_request_latency_seconds_count", 0),
                m.get("pdserve_time_to_first_token_seconds_count", 0))

    before = counts()
    _embed(server, ["one input", "and another", "a third"])
    after = counts()
    assert [b - a for a, b in zip(before, after, strict=True)] == [3, 3, 3]
