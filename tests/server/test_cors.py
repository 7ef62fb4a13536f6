"""Cross-origin requests from a browser page (CORS): any origin by default as vLLM's server,
only the listed ones with --allowed-origins, preflights answered without an API key, the
internal /pd/ routes never."""

from __future__ import annotations

import pytest

PAGE = "http://page.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def test_any_origin_may_call_the_api_by_default(server):
    status, headers, _ = server.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == PAGE
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "AUTHORIZATION" in headers["Access-Control-Allow-Headers"].upper()
    status, headers, _ = server.request("POST", "/v1/completions", BODY,
                                        headers={"Origin": PAGE})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE


def test_a_streamed_answer_carries_the_header_too(server):
    status, headers, body = server.request("POST", "/v1/completions", {**BODY, "stream": True},
                                           headers={"Origin": PAGE})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    assert body.rstrip().endswith(b"data: [DONE]")


def test_no_cross_origin_answers_on_the_internal_routes(server):
    status, headers, _ = server.request("OPTIONS", "/pd/prefill", headers=PREFLIGHT)
    assert status != 200 and "Access-Control-Allow-Origin" not in headers


@pytest.fixture(scope="module")
def listed(launch):
    return launch("--allowed-origins", "http://good.example", api_key="sk-cors")


def test_only_the_listed_origins_with_an_api_key(listed):
    # the preflight carries no key and is answered; the call itself still needs the key
    good = {**PREFLIGHT, "Origin": "http://good.example"}
    status, headers, _ = listed.request("OPTIONS", "/v1/completions", headers=good)
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == "http://good.example"
    status, headers, _ = listed.request("POST", "/v1/completions", BODY, headers={
        "Origin": "http://good.example", "Authorization": "Bearer wrong"})
    assert status == 401  # readable by the page: the error carries the header
    assert headers["Access-Control-Allow-Origin"] == "http://good.example"
    status, headers, _ = listed.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = listed.request("POST", "/v1/completions", BODY,
                                        headers={"Origin": PAGE})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
