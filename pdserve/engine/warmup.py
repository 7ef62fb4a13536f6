"""Start-up warm-up of the steps that run without graphs.

Triton compiles a kernel per specialisation of its integer arguments (a multiple of 16 or
not, equal to 1 or not) the first time it meets one. The step graphs captured at start-up
compile the shapes they pad to (multiples of 16), so the first eager step of a fresh server
(a prompt chunk past the graphs' sizes, a row count that is no multiple of 16, beside one
decode) compiled its kernels while serving: on the H200 a fresh codellama-34b multiplex
server's first mixed step took 830 ms where 52 ms were predicted, a stall its decoding
requests felt and that the online calibration read as a slow mixed step. Running those
shapes once before the server says it is ready moves the compiling to start-up.

The steps use the engine's own pages through fixture requests (the profiler's), which give
them back afterwards and never enter the prefix cache; the scheduler, its calibration and
its timeline see none of them.
"""

from __future__ import annotations

import logging
import time

from pdserve.engine.profiler import Fixtures
from pdserve.sched.base import MAIN_POOL

log = logging.getLogger(__name__)

# (decode requests beside it, prompt tokens cached ahead of the chunk)
SHAPES = ((0, 0), (1, 0), (3, 64))
DECODE_CONTEXT = 64


def eager_tokens(graph_tokens: int) -> int:
    """A chunk past the step graphs whose row count (with 1 or 3 decodes) is no multiple
    of 16."""
    return graph_tokens + 17


def skip_reason(engine) -> str | None:
    if engine.runner.device.type != "cuda":
        return "no kernels compiled on first use on this device"
    if engine.runner.comm.size > 1:
        return "not run under tensor parallelism (workers compile on their first step)"
    if MAIN_POOL not in engine.scheduler.pool_layout():
        return "this schedule runs no whole-GPU steps"
    return None


def warm_up_eager_steps(engine) -> dict:
    """Runs one eager step of each shape in ``SHAPES``; what ran, for ``describe()``."""
    why = skip_reason(engine)
    if why is not None:
        return {"skipped": why}
    return run_shapes(engine, eager_tokens(engine.runner.piecewise_tokens()))


def run_shapes(engine, tokens: int) -> dict:
    fixtures, started, steps = Fixtures(engine), time.perf_counter(), 0
    try:
        for decodes, prefix in SHAPES:
            plan = fixtures.mixed_plan(tokens, prefix, decodes, DECODE_CONTEXT)
            if plan is None:  # the pool cannot hold it: nothing to warm at this size
                continue
            engine.runner.execute(plan)
            fixtures.release()
            steps += 1
    finally:
        fixtures.release()
    seconds = time.perf_counter() - started
    log.info("warm-up: %d eager steps of %d prompt tokens in %.2f s", steps, tokens, seconds)
    return {"steps": steps, "prompt_tokens": tokens, "seconds": round(seconds, 3)}
