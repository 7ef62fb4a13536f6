"""What a request carries when its prefill and its decode run on different instances.

P/D-Serve's flow: the gateway sends a request to a prefill instance with ``target`` set (the
decode instance's KV receiver). The prefill instance computes the prompt, samples the first
token and ships the prompt's KV there under ``transfer_id`` as one contiguous buffer. The
gateway then sends the same request to the decode instance with ``first_token`` set; that
instance takes the KV that arrived under ``transfer_id`` and decodes from the second token on.

A plain dataclass below every layer, so the engine and the server (which never imports the
engine) share it.
"""

from __future__ import annotations

from dataclasses import dataclass

HANDOFF_FINISH_REASON = "handoff"
"""How a prefill instance's request ends when its decode continues elsewhere."""


@dataclass(frozen=True, slots=True)
class KVHandoff:
    transfer_id: str
    target: str | None = None
    """Prefill side: "host:port" of the decode instance's KV receiver."""
    first_token: int | None = None
    """Decode side: the first output token, sampled by the prefill instance."""
    first_logprob: float | None = None
    """Decode side: its log-probability, when the request asked for logprobs."""
    num_cached_tokens: int = 0
    """Decode side: prompt tokens the prefill instance found in its prefix cache (for usage)."""

    @property
    def is_prefill(self) -> bool:
        return self.target is not None

    @property
    def is_decode(self) -> bool:
        return self.first_token is not None

    def validate(self) -> None:
        if not self.transfer_id:
            raise ValueError("a KV hand-off needs a transfer id")
        if self.is_prefill == self.is_decode:
            raise ValueError("a KV hand-off names either a target (prefill side) or a first "
                             "token (decode side), not both or neither")
