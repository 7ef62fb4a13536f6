"""POST /reset_prefix_cache (vLLM's route, SGLang's /flush_cache): a prompt served twice
hits the prefix cache the second time and not after the reset; the answer counts what
was forgotten. The API key it needs: test_auth.py."""

from __future__ import annotations

import json

# A prompt no other test sends, several KV blocks long.
PROMPT = "reset prefix cache probe: " + " ".join(f"w{i}" for i in range(80))


def _cached_tokens(server) -> int:
    status, _, raw = server.request("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert status == 200
    return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_reset_forgets_a_served_prompt(server):
    _cached_tokens(server)
    assert _cached_tokens(server) > 0  # served twice: the second hits
    status, _, raw = server.request("POST", "/reset_prefix_cache", b"")
    assert status == 200
    answer = json.loads(raw)
    assert answer["object"] == "prefix_cache.reset"
    assert answer["forgotten_blocks"] > 0 and answer["cached_blocks_in_use"] == 0  # idle
    assert _cached_tokens(server) == 0
    assert _cached_tokens(server) > 0  # and caches again
