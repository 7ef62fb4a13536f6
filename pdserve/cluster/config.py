"""Flags of the cluster pieces: the gateway, an instance's place in a P/D group, the ratio
controller. Field docs are also the command line's ``--help``."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import doc
from pdserve.server.cors import CrossOriginConfig
from pdserve.server.tls import TLSConfig


@dataclass(frozen=True)
class GatewayConfig(CrossOriginConfig, TLSConfig):
    host: str = doc("0.0.0.0", "Address the gateway binds.")
    port: int = doc(8000, "TCP port of the gateway.")
    registry: str = doc("memory://", "Where P/D groups are listed: zk://HOST:PORT[,...][/ROOT] "
                        "(ZooKeeper) or memory:// (this process only).")
    default_scenario: str = doc("default", "Scenario of requests that name none.")
    scenario_header: str = doc("X-PD-Scenario", "HTTP header that names a request's scenario.")
    dispatch: str = doc("on-demand", "How prefills are placed: on-demand (offer, least busy "
                        "first; an instance refuses what it cannot start in time and the next "
                        "one is tried), least-connections (fewest prefills in flight from "
                        "here, never refused) or round-robin (in turn, never refused).")
    ttft_slo_ms: float = doc(2000.0, "Time-to-first-token target: a prefill instance refuses a "
                             "request it could not start within what is left of it.")
    max_wait_s: float = doc(30.0, "Longest a request waits at the gateway while every prefill "
                            "instance refuses it (then 503 with Retry-After).")
    retry_poll_ms: float = doc(50.0, "A request every prefill instance refused is offered "
                               "again when a prefill this gateway placed ends, or after this "
                               "long (room freed by other gateways).")
    connect_timeout: float = doc(5.0, "Seconds to connect to an instance.")
    stall_timeout_s: float = doc(120.0, "An instance that sends nothing for this long while "
                                 "it prefills or streams an answer counts as failed.")
    max_attempts: int = doc(4, "Instances one request may be tried on: one that fails (dies, "
                            "loses the KV, answers 5xx) hands the request to another; a "
                            "stream resumes after the tokens the client already has.")
    shutdown_timeout: float = doc(30.0, "On SIGTERM or SIGINT, seconds the requests in flight "
                                  "through the gateway may run (new ones are no longer "
                                  "accepted); then the rest are cut.")
    api_key: str | None = doc(None, "If set, clients need 'Authorization: Bearer KEY'.")
    cluster_secret: str | None = doc(None, "Secret sent to the instances' internal /pd/ "
                                     "routes (their --cluster-secret); default: "
                                     "$PDSERVE_CLUSTER_SECRET.")
    retry_after: int = doc(1, "Seconds sent in Retry-After with 429 and 503 answers.")
    max_request_bytes: int = doc(16 * 1024 * 1024, "Largest HTTP request body accepted.")
    body_timeout_s: float = doc(30.0, "A request's body must arrive within this long (a slow "
                                "or stalled client gets 408).")
    max_concurrent_requests: int = doc(4096, "Requests answered at once, streams included; "
                                       "more get 429 with Retry-After.")
    max_stored_responses: int = doc(1000, "Responses /v1/responses keeps in this gateway's "
                                    "memory for previous_response_id and GET "
                                    "/v1/responses/{id} (the oldest forgotten first); 0 keeps "
                                    "none. Each gateway keeps its own.")
    ratio_interval_s: float = doc(0.0, "Dynamic P/D ratio: seconds between the controller's "
                                  "looks at each scenario's latencies; 0 disables it.")

    def __post_init__(self) -> None:
        self.check_tls()


@dataclass(frozen=True)
class RatioConfig:
    """When the controller moves an instance between roles (P/D-Serve's dynamic ratio). It
    judges the window since its last move (or restart): current pressure, not history."""

    reject_rate_high: float = 0.2
    """Share of the window's requests every prefill instance refused at their first offer,
    above which prefill is short (if its backlog is not draining)."""
    ttft_share_high: float = 0.5
    """Or: TTFT above this share of E2E latency, over requests that arrived in the window
    (blind dispatch refuses nothing; this is its prefill signal)."""
    decode_growth_high: float = 0.2
    """Decode is short when its backlog (requests handed to decode, answer not ended) grew by
    more than this share of the requests handed to it in the window."""
    drain: float = 0.1
    """A side whose backlog shrank over the window by more than this share of the requests
    it got through is draining: prefill then is not short, and decode (still catching up on
    a shortage) gives no instance away."""
    min_requests: int = 20
    """Requests a window needs before it is judged."""
    decode_window_s: float = 60.0
    """Age a window needs before decode backlog growth is judged: after any change a decode
    instance's backlog fills for about one request's decode time, which is no shortage."""
    window_s: float = 120.0
    """A window this old without a move is restarted, so that it stays current."""
    cooldown_s: float = 20.0
    """Age a window needs before it is judged; a move opens a new window, so this is also the
    least time between two moves in one scenario (a moved instance needs time to drain)."""
    memory_s: float = 600.0
    """For this long after decode was found short, no move to prefill leaves it that few
    instances again."""


@dataclass(frozen=True)
class InstanceConfig:
    role: str | None = doc(None, "Join a P/D group as a prefill or decode instance "
                           "(needs --kv-transfer-port); unset: a standalone server.")
    registry: str = doc("memory://", "Registry to join: zk://HOST:PORT[,...][/ROOT] (memory:// "
                        "only reaches a gateway in the same process).")
    scenario: str = doc("default", "Scenario (P/D group) this instance serves.")
    instance_id: str | None = doc(None, "Name in the registry; defaults to HOST:PORT.")
    advertise_host: str = doc("127.0.0.1", "Host other machines use to reach this instance's "
                              "HTTP port.")
