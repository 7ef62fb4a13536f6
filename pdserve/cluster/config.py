"""Flags of the cluster pieces: the gateway, an instance's place in a P/D group, the ratio
controller. Field docs are also the command line's ``--help``."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import doc


@dataclass(frozen=True)
class GatewayConfig:
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
    api_key: str | None = doc(None, "If set, clients need 'Authorization: Bearer KEY'; the "
                              "gateway sends the same key to the instances.")
    retry_after: int = doc(1, "Seconds sent in Retry-After with 429 and 503 answers.")
    ratio_interval_s: float = doc(0.0, "Dynamic P/D ratio: seconds between the controller's "
                                  "looks at each scenario's latencies; 0 disables it.")


@dataclass(frozen=True)
class RatioConfig:
    """When the controller moves an instance between roles (P/D-Serve's dynamic ratio)."""

    ttft_share_high: float = 0.5
    """TTFT above this share of E2E latency: prefill is the bottleneck."""
    ttft_share_low: float = 0.15
    """TTFT below this share, with few refusals: decode is the bottleneck."""
    reject_rate_high: float = 0.2
    """Share of requests every prefill instance refused at first, above which prefill is
    short of capacity."""
    reject_rate_low: float = 0.05
    """Below this share of refused requests, prefill can spare an instance."""
    min_requests: int = 20
    """Requests a window needs before it is judged."""
    cooldown_s: float = 30.0
    """Least time between two moves in one scenario (a moved instance needs time to drain)."""


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
