"""How a gateway offers a request to prefill instances (``--dispatch``), apart from the
gateway's HTTP machinery so that the fleet simulator (``pdserve/sim``), which runs the same
offer order, imports no web framework."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.cluster.registry import Instance

DISPATCH = ("on-demand", "least-connections", "round-robin")


def order_prefill(candidates: list[Instance], dispatch: str, load: Mapping[str, int],
                  turn: int) -> list[Instance]:
    """The order in which a request is offered to prefill instances: in turn for
    round-robin, else fewest prefills in flight from this gateway first."""
    if dispatch == "round-robin" and candidates:
        start = turn % len(candidates)
        return candidates[start:] + candidates[:start]
    return sorted(candidates, key=lambda i: (load[i.instance_id], i.instance_id))
