"""Start-up warm-up of the steps that run without graphs.

Triton compiles a kernel per specialisation of its integer arguments (a multiple of 16 or
not, equal to 1 or not) the first time it meets one. The step graphs captured at start-up
compile the shapes they pad to (multiples of 16), so the first eager step of a fresh server
(a prompt chunk past the graphs' sizes, a row count that is no multiple of 16, beside one
decode) compiled its kernels while serving: on the H200 a fresh codellama-34b multiplex
server's first mixed step took 830 ms where 52 ms were predicted, a stall its decoding
requests felt and that the online calibration read as a slow mixed step. Running those
shapes once before the server says it is ready moves the compiling to start-up.

Decode attention compiles per split count launched too (a constexpr): decode rows split
each sequence's context by a count that falls as the decode batch grows (codellama-34b on
132 SMs: 32 splits for one decode, 16 for 3-4, 8 for 5-66 with long contexts balanced, 4
for 67-132, 2 for 133-264, 1 beyond; without balancing 4 for 9-16, 2 for 17-33, 1 beyond).
At 6f2d50e, warmed with 1 and 3 decodes only, fresh servers still stalled 7-34x on their
first mixed steps beside 5, 9-10, 17-19 and 33 decodes (ShareGPT-like): each split count
gets a step of its own now, and so does each width of the lengths a balanced launch loads
(another constexpr: the decode batch rounded up to a power of two, 16 to 512). Decode-only
steps compile those variants with the rotary and K/V store fused in: the decode graphs
compile them at capture, and decode-only batches no graph serves get a step each. Stalls
behind 6.6-7.7K-token prefixes (the Mooncake trace) have no cause pinned down, so chunks
behind 512-8,192-token prefixes are run too, and the next runs' stall census tells.

The extend kernel compiles per prefix split count as well (``extend_kv_splits``: short
chunks over long prefixes, and grids that fill their last wave badly, split), and with
the tail launch per split count of its packed tiles: one chunk per variant the rule can
launch for this model, behind a prefix that gives it, on the whole GPU or alone on the SM
partition whose prefill launches it (the rule counts a launch's SMs).

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
# Prefixes ahead of a warm-up chunk (beside one decode), up to the 6.6-7.7K behind which
# Mooncake-trace mixed steps stalled on fresh servers.
PREFIXES = (512, 1024, 2048, 4096, 8192)


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
    """Runs one eager step of each shape ``shapes`` lists; what ran, for ``describe()``."""
    why = skip_reason(engine)
    if why is not None:
        return {"skipped": why}
    tokens = eager_tokens(engine.runner.piecewise_tokens())
    return run_shapes(engine, tokens, shapes(engine, tokens))


def shapes(engine, tokens: int) -> list[tuple]:
    """``SHAPES``, then one decode batch per decode kernel variant the attention backend
    launches up to the engine's largest batch (``decode_split_batches``), then one decode
    beside a ``tokens`` chunk behind each of ``PREFIXES`` that fits the context; then, as
    ``(batch, None)``, decode-only batches no decode graph serves (``eager_decode_batches``);
    then, as ``(1, prefix, chunk, sms)``, one decode beside a chunk of each extend split
    count (``extend_split_chunks``), on the whole GPU (``sms`` None) or, for a count only an
    SM partition's prefill launches, a chunk alone on that partition.
    """
    backend, kv_heads, device = (engine.runner.attn_backend, engine.arch.num_kv_heads,
                                 engine.runner.device)
    most = engine.config.scheduler.max_num_seqs
    batches = decode_split_batches(backend, kv_heads, device, most)
    warmed = {decodes for decodes, prefix in SHAPES if prefix == 0}
    longest = engine.runner.max_model_len
    graphed = largest_graphed_decode(engine)
    return [*SHAPES, *((n, 0) for n in batches if n not in warmed),
            *((1, prefix) for prefix in PREFIXES if prefix + tokens <= longest),
            *((n, None) for n in eager_decode_batches(backend, kv_heads, device, graphed, most)),
            *((1, prefix, chunk, sms) for chunk, prefix, sms in extend_split_chunks(
                engine.arch, device, longest, engine.config.scheduler.max_num_batched_tokens,
                partition_sms=sorted(_prefill_partitions(engine))))]


def _prefill_partitions(engine) -> dict[int, object]:
    """The SM partitions a prefill may run on, by their prefill SMs (none for a schedule
    that runs on the whole GPU only)."""
    return {part.prefill_sms: part for part in engine.scheduler.graph_partitions() or ()
            if not part.whole_gpu}


def extend_split_chunks(arch, device, longest: int, most_tokens: int, config=None,
                        partition_sms=()) -> list[tuple[int, int, int | None]]:
    """(chunk tokens, prefix, SMs) of the first chunk meeting each extend kernel variant
    (q heads per tile row block, prefix split count) that one unsplit launch of unpacked
    tiles is not, for ``arch`` under ``config`` (``ExtendConfig``; default: the device's):
    the auto rule's split counts past 1 (none where the splits are fixed) and, with the
    tail launch, its packed tiles at each count. Chunks of whole query tiles under
    ``most_tokens``, and with the tail launch those tiles plus each count of packed tail
    tiles; prefixes powers of two times the split's least share and the longest, within
    ``longest``; on the whole device (SMs None) where it launches that variant, else on the
    first of ``partition_sms`` (the rule counts a launch's own SMs, so a partition's prefill
    meets counts the whole GPU does not)."""
    if device.type != "cuda" and config is None:
        return []  # the interpreter's tiles keep one split; and no Triton import on a CPU
    from pdserve.ops.triton_attention import (
        MIN_EXTEND_SPLIT_TOKENS,
        LaunchShape,
        default_extend_config,
        plan_extend_launches,
    )

    config = config or default_extend_config(arch.head_dim, device)
    if config.kv_splits != 0 and not config.tail_tiles:
        return []
    group = arch.num_heads // arch.num_kv_heads
    seen, found = {(1, 1)}, []  # SHAPES' chunks launch one unsplit launch of unpacked tiles
    for sms in (None, *partition_sms):
        for chunk in _warm_chunks(config, group, most_tokens):  # a decode beside
            for prefix in _warm_prefixes(MIN_EXTEND_SPLIT_TOKENS, longest - chunk):
                shape = LaunchShape(arch.num_heads, 1, prefix, device, sms)
                met = {(launch.row_heads, launch.splits)
                       for launch in plan_extend_launches(config, chunk, group, shape)}
                if not met <= seen:
                    found.append((chunk, prefix, sms))
                    seen |= met
    return found


def _warm_chunks(config, group: int, most_tokens: int) -> list[int]:
    """Chunks of whole query tiles under ``most_tokens``; with the tail launch, also each of
    them plus each count of packed tail tiles it may launch (up to half a tile of rows).
    Where the tail cannot pack, the extra chunks launch nothing new and add no step."""
    whole = range(config.block_m, most_tokens, config.block_m)
    if not config.tail_tiles:
        return list(whole)
    tokens = config.block_m // group  # a packed tile's tokens
    tails = range(tokens, config.block_m // 2 + 1, tokens)
    return [chunk for base in (0, *whole) for chunk in (base, *(base + t for t in tails))
            if 0 < chunk < most_tokens]


def _warm_prefixes(least: int, longest: int) -> list[int]:
    """``least`` doubled while within ``longest``, then ``longest`` itself (a count the rule
    launches only past the last power of two)."""
    found = []
    while least <= longest:
        found.append(least)
        least *= 2
    return found + [longest] if found and found[-1] != longest else found


def decode_split_batches(backend, kv_heads: int, device, most: int) -> list[int]:
    """The smallest decode batch of each decode kernel variant ``backend.decode_variant``
    gives up to ``most`` decodes (split count and balanced width; none for a backend
    without variants)."""
    return _first_of_each_variant(backend, kv_heads, device, range(1, most + 1))


def eager_decode_batches(backend, kv_heads: int, device, graphed: int, most: int) -> list[int]:
    """The smallest decode-only batch of each decode kernel variant among the batches
    that run without a graph: past ``graphed`` (the largest decode graph; 0 with graphs
    off) up to ``most``. Decode-only steps fuse the rotary and K/V store into attention, a
    variant of its own that the mixed steps above never compile."""
    return _first_of_each_variant(backend, kv_heads, device, range(graphed + 1, most + 1))


def _first_of_each_variant(backend, kv_heads: int, device, batches: range) -> list[int]:
    variant = getattr(backend, "decode_variant", None)
    if variant is None:
        return []
    first: dict[tuple, int] = {}
    for batch in batches:
        first.setdefault(variant(batch, kv_heads, device), batch)
    return sorted(first.values())


def largest_graphed_decode(engine) -> int:
    """The largest decode batch every captured decode graph set of the whole-GPU pool
    replays (0 with none captured): past it, some lane decodes eagerly."""
    runners = engine.runner.pools[MAIN_POOL].graphs.values()
    return min((max(runner.graphs, default=0) for runner in runners), default=0)


def _shape(shape: tuple, tokens: int) -> tuple[int, int | None, int, int | None]:
    """(decodes, prefix, chunk, partition's prefill SMs) of a ``shapes`` entry."""
    decodes, prefix, *rest = shape
    return decodes, prefix, rest[0] if rest else tokens, rest[1] if len(rest) > 1 else None


def run_shapes(engine, tokens: int, shapes: list[tuple] = SHAPES) -> dict:
    """One eager step of each ``(decodes, prefix)``: a ``tokens`` chunk behind ``prefix``
    cached tokens beside that many decodes, or with ``prefix`` None the decodes alone; a
    ``(decodes, prefix, chunk)`` takes a chunk of its own size, and a ``(decodes, prefix,
    chunk, sms)`` with ``sms`` set runs the chunk alone on the SM partition whose prefill
    has that many SMs (skipped where the schedule has none)."""
    fixtures, started, steps = Fixtures(engine), time.perf_counter(), 0
    partitions = _prefill_partitions(engine)
    try:
        for shape in shapes:
            decodes, prefix, chunk, sms = _shape(shape, tokens)
            part = partitions.get(sms)
            if sms is not None and part is None:
                continue
            if part is not None:  # a partition's prefill runs alone there
                decodes = 0
            plan = (fixtures.decode_plan(decodes, DECODE_CONTEXT) if prefix is None
                    else fixtures.mixed_plan(chunk, prefix, decodes, DECODE_CONTEXT))
            if plan is None:  # the pool cannot hold it: nothing to warm at this size
                continue
            engine.runner.execute(plan, partition=part)
            fixtures.release()
            steps += 1
    finally:
        fixtures.release()
    seconds = time.perf_counter() - started
    log.info("warm-up: %d eager steps of %d prompt tokens in %.2f s", steps, tokens, seconds)
    return {"steps": steps, "prompt_tokens": tokens, "seconds": round(seconds, 3)}
