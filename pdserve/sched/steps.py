"""The step timeline of the whole-GPU policies (chunked prefill, prefill-first): one entry
per launched step with its shape and its measured time, what ``GET /v1/engine/timeline``
serves for them.

A step's time depends on its shape: how many decodes and over how much KV, how many prompt
tokens in which pieces over which prefixes, and whether it replayed CUDA graphs or ran
eagerly. The entry keeps all of that beside the step's time on the host and on the GPU, so
a model of the step (``pdserve.sim.instance.mixed_step_s``) can be checked step by step
against a served run, not only through the latency percentiles its queue produces.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # base.py makes the timeline: no import back at run time
    from pdserve.sched.base import Plan, StepOutput, Work

STEP_TIMELINE_LENGTH = 20_000  # steps kept for ``timeline()``; older ones are dropped


@dataclass(slots=True)
class StepEntry:
    """One launched step of a whole-GPU policy."""

    time: float  # time.monotonic() when the step was planned
    mode: str  # "decode_only", "mixed" (decodes and prompt pieces) or "prefill_only"
    decode_batch: int
    decode_context_tokens: int  # KV tokens the decodes attend over, summed
    prefill_tokens: int  # prompt tokens of every piece
    prefill_context_tokens: int  # prompt tokens already cached ahead of the pieces, summed
    # Each prompt piece as [tokens cached ahead of it, its tokens], in the step's order:
    # attention over a prefix costs per piece, not per step.
    prefill_pieces: list[list[int]] = field(default_factory=list)
    # How the runner ran it: "decode_graph", "piecewise_graph" or "eager" ("": not known,
    # e.g. a launch that failed).
    path: str = ""
    measured_cycle_ms: float = 0.0  # issue (or the previous step's end) to completion seen
    measured_device_ms: float = 0.0  # on the GPU's clock (0: no device clock, e.g. CPU)


def step_entry(plan: Plan, now: float | None = None) -> StepEntry:
    """The entry of ``plan`` as planned: before its counters advance at issue. A prompt's
    last token alone (a chunk that left just one) rides with the decodes in ``plan`` but is
    a prompt piece here: it samples the first token, over its prompt."""
    decodes = context = 0
    layout = []
    for item in plan.decodes:  # one pass: this runs on every step, up to 256 decodes
        request = item.request
        if request.num_computed < request.num_prompt_tokens:
            layout.append([request.num_computed, 1])
        else:
            decodes += 1
            context += request.num_tokens
    layout += [[s.request.num_computed, s.num_new_tokens] for s in plan.prefills]
    mode = "mixed" if decodes and layout else "prefill_only" if layout else "decode_only"
    return StepEntry(time.monotonic() if now is None else now, mode, decodes, context,
                     sum(n for _, n in layout), sum(done for done, _ in layout), layout)


class StepTimeline:
    """The most recent steps of one policy, oldest first."""

    def __init__(self, length: int = STEP_TIMELINE_LENGTH) -> None:
        self._entries: deque[StepEntry] = deque(maxlen=length)

    def planned(self, plan: Plan) -> StepEntry:
        entry = step_entry(plan)
        self._entries.append(entry)
        return entry

    @staticmethod
    def completed(work: Work, output: StepOutput) -> None:
        """A step completed: its entry (the work's note) gets its times and path."""
        entry = work.note
        if not isinstance(entry, StepEntry):
            return
        entry.path = work.path
        entry.measured_cycle_ms = output.elapsed_ms or 0.0
        entry.measured_device_ms = output.device_ms or 0.0

    def entries(self, since: float | None = None) -> list[dict]:
        return [asdict(e) for e in self._entries if since is None or e.time >= since]
