"""One instance with chunked prefill (``pdserve serve --schedule chunked``), step by step:
the structure of the real scheduler's steps, not one slowdown factor for each side.

Each step carries one token of every running request and, in the rest of the token
budget (``chunk_size``), the next pieces of waiting prompts, first come first served. A
step without prompt pieces takes the decode batch's step time. A mixed step (``mixed_step_s``)
reads the weights once for all its tokens: its linear layers take the longer of the decode
batch's weight-bound step (``decode_base_s + decode_per_request_s * batch``) and the
compute of every token in it (``prefill_per_token_s`` times the pieces' tokens and the
decode tokens); attention adds what each piece's prefill grows by in the quadratic part
(over its prefix) and the decode batch's KV read. A prompt whose last piece ran gets its
first token at the end of that step and decodes from the next.

Two things of the real engine that steps measured apart do not show, both measured on the
H200 (``benchmarks/sim_validate_instance.py``): ``mixed_step_extra_s``, what a step with
prompt pieces beside decodes costs beyond ``mixed_step_s`` (fitted on the validation's lone
interference probe: about 2 ms a step at efbfdd5), and ``overlap``: the engine plans step
k + 1 as it issues step k (overlap scheduling, on by default), so a prompt that arrives
while a step runs starts in the step after the next one.

With the grid terms of ``LatencyModel`` fitted (``fit_mixed_step_grid``, on a measured grid
of mixed steps: ``bench_mixed_step.py --grid``) a piece's attention over its prefix costs at
least a floor per prefix token (the kernel is latency-bound for small pieces), and a step
costs its kernels plus what the model misses of them on its path: the piecewise CUDA
graphs up to their largest step, else eager, never under the host's launch floor. Those
terms at zero are the roofline form above, computed as it was.

``mixed_step="sum"`` is the model as it was until the H200 validation at eb12b7d (a mixed
step took the decode step plus each piece's whole prefill increment: the weights read
twice); kept so that that run's simulated figures can be reproduced offline.
``prefill_base_s`` (a fixed cost per request measured around the engine: HTTP,
tokenizing) delays the answer's tokens without holding the engine. With
``noise`` each step takes a drawn measured ratio times its modelled time.

``step_budget_s``: while requests decode, a step takes the most prompt tokens (up to
``chunk_size`` less the decodes) whose modelled step stays within the budget, at least one
token so that prefill always moves: chunked prefill sized to an inter-token target by a
perfect predictor, which no served schedule runs as such (multiplexing's mixed steps are
sized to its ITL target, by a fitted predictor). A step with nothing decoding takes up to
``chunk_size``.

``prefill_order="slo"`` (with ``ttft_slo_s``) keeps the prompts not yet started in the
engine's ``--prefill-order slo`` order (``slo_rank``), behind the ones already part
prefilled; the service time of a prompt is its prefill alone in this model (the engine
learns a rate instead). ``max_wait_s`` is the engine's ``--prefill-order-max-wait-ms``:
prompts waiting that long go first.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import numpy as np

from pdserve.config import check_prefill_order
from pdserve.sched.prefill_order import slo_rank
from pdserve.sim.cluster import EventLoop, LatencyModel, ServiceNoise, SimRequest

MIXED_STEP_MODELS = ("roofline", "sum")


def mixed_step_s(model: LatencyModel, batch: int, context: int,
                 pieces: list[tuple[int, int]]) -> float:
    """One step of ``batch`` decode tokens over ``context`` KV tokens and prompt ``pieces``
    (tokens done before, tokens now), on the path the engine runs it (``step_on_path_s``)."""
    tokens = batch + sum(n for _, n in pieces)
    return step_on_path_s(model, tokens, mixed_step_kernels_s(model, batch, context, pieces))


def chunked_step_s(model: LatencyModel, batch: int, context: int,
                   pieces: list[tuple[int, int]], extra_s: float = 0.0) -> float:
    """One step of chunked prefill: the decode batch's step where it has no prompt pieces,
    else the mixed step (``mixed_step_s``) plus ``extra_s`` if it also decodes (what a
    step with pieces beside decodes costs beyond that: ``mixed_step_extra_s``)."""
    if not pieces:
        return model.decode_step_s(batch, context) if batch else 0.0
    return (extra_s if batch else 0.0) + mixed_step_s(model, batch, context, pieces)


def recorded_step_s(model: LatencyModel, entry: dict, extra_s: float = 0.0) -> float:
    """``chunked_step_s`` of one step a served run recorded (``pdserve.sched.steps``): its
    decodes, their KV tokens and its prompt pieces as the engine planned them."""
    return chunked_step_s(model, entry["decode_batch"], entry["decode_context_tokens"],
                          [(done, tokens) for done, tokens in entry["prefill_pieces"]],
                          extra_s)


def mixed_step_kernels_s(model: LatencyModel, batch: int, context: int,
                         pieces: list[tuple[int, int]]) -> float:
    """The step's GPU work: the weights are read once, so the linear layers cost the larger
    of the weight-bound decode step and the compute of all the step's tokens; then each
    piece's attention (``pieces_attention_s``) and the decode batch's KV read."""
    tokens = batch + sum(n for _, n in pieces)
    weights_s = model.decode_base_s + model.decode_per_request_s * batch
    linear_s = max(weights_s, model.prefill_per_token_s * tokens)
    attention_s = pieces_attention_s(model, pieces)
    return linear_s + attention_s + model.decode_per_kv_token_s * context


def pieces_attention_s(model: LatencyModel, pieces: list[tuple[int, int]]) -> float:
    """The pieces' attention. Without a fitted pair cost, the roofline form: what each
    piece's prefill grows by in the quadratic part, summed as it always was (the committed
    re-simulations reproduce to the last digit)."""
    if not model.mixed_prefix_per_pair_s:
        return model.prefill_per_token_sq_s * sum(
            (done + n) ** 2 - done ** 2 for done, n in pieces)
    return sum(prefix_attention_s(model, done, n) for done, n in pieces)


def prefix_attention_s(model: LatencyModel, done: int, tokens: int) -> float:
    """A piece of ``tokens`` after ``done`` of its prompt, in the grid form: the square
    among its own tokens, and over the prefix the larger of the latency-bound floor (a cost
    per prefix token whatever the piece's size: measured the same for 64 to 256 tokens)
    and the work of every (token, prefix token) pair."""
    over_prefix_s = max(model.mixed_prefix_floor_per_token_s * done,
                        model.mixed_prefix_per_pair_s * tokens * done)
    return model.prefill_per_token_sq_s * tokens ** 2 + over_prefix_s


def step_on_path_s(model: LatencyModel, tokens: int, kernels_s: float) -> float:
    """A step of ``tokens`` whose kernels take ``kernels_s``: replayed as the piecewise CUDA
    graphs where it fits them, else launched eagerly, which the host bounds from below.
    With the fields at zero: the kernels' time (the roofline form)."""
    if tokens <= model.mixed_graph_max_tokens:
        return kernels_s + model.mixed_graph_extra_s
    return max(model.mixed_eager_floor_s, kernels_s + model.mixed_eager_extra_s)


def grid_case_kernels_s(model: LatencyModel, case: dict) -> float:
    """``mixed_step_kernels_s`` of one measured grid step (``bench_mixed_step.py --grid``:
    a piece after a prefix beside decodes, each decode over ``decode_context`` tokens)."""
    decodes = case["decodes"]
    return mixed_step_kernels_s(model, decodes, decodes * case["decode_context"],
                                [(case["prefix"], case["prefill_tokens"])])


def grid_case_s(model: LatencyModel, case: dict) -> float:
    """``mixed_step_s`` of one measured grid step."""
    tokens = case["prefill_tokens"] + case["decodes"]
    return step_on_path_s(model, tokens, grid_case_kernels_s(model, case))


def fit_mixed_step_grid(model: LatencyModel, grid: dict) -> LatencyModel:
    """This model with the mixed step's grid terms fitted to a measured grid of mixed steps
    (``bench_mixed_step.py --grid``; its other terms kept): the prefix attention's floor and
    pair cost (``fit_prefix_attention``), the graphs' largest step from the grid's buckets,
    what the modelled kernels miss of the measured kernel time on each path (the median
    over its steps), and the eager step's launch floor (``fit_eager_floor``).

    Kernel time, not the step as timed from the host: the engine's overlap scheduling
    issues step k + 1 while step k runs, so the host's share stays hidden where the GPU's
    outlasts it (fitted to the synchronous host timing instead, the validation's queue
    probe simulates slower than measured). An eager step cannot be shorter than the
    host's launches, overlap or not: its floor."""
    cases = grid["cases"]
    floor_s, pair_s = fit_prefix_attention(cases)
    fitted = replace(model, mixed_prefix_floor_per_token_s=floor_s,
                     mixed_prefix_per_pair_s=pair_s,
                     mixed_graph_max_tokens=max(grid["piecewise_buckets"]))
    graph = [on_graphs(fitted, c) for c in cases]
    missed = [c["kernel_sum_ms"] / 1e3 - grid_case_kernels_s(fitted, c) for c in cases]
    return replace(fitted, mixed_graph_extra_s=float(np.median(np.array(missed)[graph])),
                   mixed_eager_extra_s=float(np.median(np.array(missed)[np.invert(graph)])),
                   mixed_eager_floor_s=fit_eager_floor(cases))


def on_graphs(model: LatencyModel, case: dict) -> bool:
    """Whether serving replays a grid step as the piecewise graphs (else: eagerly)."""
    return case["prefill_tokens"] + case["decodes"] <= model.mixed_graph_max_tokens


def prefix_costs(cases: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(piece tokens, seconds per prefix token) of each grid step over a prefix: its
    kernels' time less the same step's at prefix 0, over the prefix. Kernel time, not the
    wall: the host's share does not grow with the prefix."""
    at_zero = {(c["prefill_tokens"], c["decodes"], c["decode_context"]): c["kernel_sum_ms"]
               for c in cases if c["prefix"] == 0}
    over = [c for c in cases if c["prefix"] > 0]
    tokens = np.array([c["prefill_tokens"] for c in over], dtype=float)
    per_prefix_token = np.array([
        (c["kernel_sum_ms"] - at_zero[c["prefill_tokens"], c["decodes"], c["decode_context"]])
        / 1e3 / c["prefix"] for c in over])
    return tokens, per_prefix_token


def fit_prefix_attention(cases: list[dict]) -> tuple[float, float]:
    """(floor per prefix token, cost per pair) of ``max(floor, pair * tokens)`` per prefix
    token: for each split between the pieces' sizes, the floor is the median below it and
    the pair cost the least-squares slope through 0 above it, in relative error; the split
    with the smallest relative error wins."""
    tokens, cost = prefix_costs(cases)
    best = (math.inf, 0.0, 0.0)
    for split in sorted(set(tokens))[:-1]:
        small, large = tokens <= split, tokens > split
        floor = float(np.median(cost[small]))
        pair = float(np.sum(tokens[large] / cost[large])
                     / np.sum((tokens[large] / cost[large]) ** 2))
        error = float(np.sum((np.maximum(floor, pair * tokens) / cost - 1) ** 2))
        best = min(best, (error, floor, pair))
    return best[1], best[2]


def fit_eager_floor(cases: list[dict]) -> float:
    """The eager step's floor in ``max(floor, kernels)`` against every grid step's eager
    time: the measured value (or none) with the least mean absolute relative error, an L1
    fit that a warm-up outlier or two does not pull."""
    measured = np.array([c["eager_ms"] / 1e3 for c in cases])
    kernels = np.array([c["kernel_sum_ms"] / 1e3 for c in cases])
    floors = np.append(measured, 0.0)
    error = np.mean(np.abs(np.maximum(floors[:, None], kernels[None, :]) / measured - 1),
                    axis=1)
    return float(floors[np.argmin(error)])


class ChunkedInstanceSim:
    def __init__(self, model: LatencyModel, chunk_size: int = 512,
                 noise: ServiceNoise | None = None, max_batch: int = 256,
                 mixed_step: str = "roofline", mixed_step_extra_s: float = 0.0,
                 overlap: bool = False, prefill_order: str = "fcfs",
                 ttft_slo_s: float | None = None, step_budget_s: float | None = None,
                 max_wait_s: float | None = None) -> None:
        if mixed_step not in MIXED_STEP_MODELS:
            raise ValueError(f"mixed_step must be one of {', '.join(MIXED_STEP_MODELS)}")
        if step_budget_s is not None and step_budget_s <= 0:
            raise ValueError(f"step_budget_s must be positive, got {step_budget_s}")
        self.step_budget_s = step_budget_s
        check_prefill_order(prefill_order, None if ttft_slo_s is None else ttft_slo_s * 1e3,
                            None if max_wait_s is None else max_wait_s * 1e3)
        self.prefill_order, self.ttft_slo_s = prefill_order, ttft_slo_s
        self.max_wait_s = max_wait_s
        self.model, self.chunk_size, self.max_batch = model, chunk_size, max_batch
        self.noise, self.mixed_step = noise, mixed_step
        self.mixed_step_extra_s, self.overlap = mixed_step_extra_s, overlap
        self._planned_at = 0.0  # when this step's plan was made (overlap: the last start)
        self.loop = EventLoop()
        self.waiting: deque[list] = deque()  # [request, prompt tokens done]
        self.running: list[list] = []  # [request, tokens still to decode]
        self._stepping = False
        self._noise_step = noise.start() if noise is not None else 0

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        for request in requests:
            self.loop.at(request.arrival, self._arrive, request)
        self.loop.run()
        return requests

    def _arrive(self, request: SimRequest) -> None:
        self.waiting.append([request, 0])
        if not self._stepping:
            self._stepping = True
            self.loop.at(self.loop.now, self._step)

    def _step(self) -> None:
        if not (self.running or self.waiting):
            self._stepping = False
            return
        if self.prefill_order == "slo":
            self._order_waiting()
        pieces = self._budgeted_pieces()
        self._planned_at = self.loop.now
        seconds = self._step_s(pieces)
        if self.noise is not None:
            seconds *= self.noise.span(self._noise_step, self._noise_step + 1)[0]
            self._noise_step += 1
        self.loop.at(self.loop.now + seconds, self._end_step, pieces)

    def _budgeted_pieces(self) -> list[tuple[list, int, int]]:
        """This step's pieces: the chunk's tokens, or with ``step_budget_s`` while requests
        decode the most tokens whose step fits the budget (the step grows with its tokens,
        so by bisection), at least one."""
        tokens = self.chunk_size - len(self.running)
        if self.step_budget_s is None or not self.running:
            return self._pieces(tokens)
        low, high = 1, max(tokens, 1)  # low: the least taken, fitting or not
        while low < high:
            middle = (low + high + 1) // 2
            if self._step_s(self._pieces(middle)) <= self.step_budget_s:
                low = middle
            else:
                high = middle - 1
        return self._pieces(low)

    def _pieces(self, budget: int) -> list[tuple[list, int, int]]:
        """(entry, tokens done before, tokens now) of each waiting prompt in this step."""
        pieces: list[tuple[list, int, int]] = []
        planned_at = self._planned_at if self.overlap and self.running else self.loop.now
        for entry in self.waiting:
            if budget <= 0 or len(self.running) + len(pieces) >= self.max_batch:
                break
            if entry[1] == 0 and entry[0].arrival > planned_at:
                break  # arrived after this step was planned (``overlap``)
            take = min(budget, entry[0].input_len - entry[1])
            pieces.append((entry, entry[1], take))
            budget -= take
        return pieces

    def _order_waiting(self) -> None:
        """Part-prefilled prompts first, in their order; the rest as ``slo_rank`` puts them,
        from when the started ones will be done."""
        assert self.ttft_slo_s is not None
        started = [e for e in self.waiting if e[1] > 0]
        fresh = [e for e in self.waiting if e[1] == 0]
        start = self.loop.now + sum(self._piece_s(e[1], e[0].input_len - e[1]) for e in started)
        ranked, _ = slo_rank([(e[0].arrival, self._piece_s(0, e[0].input_len)) for e in fresh],
                             start, self.ttft_slo_s, self.loop.now, self.max_wait_s)
        self.waiting = deque(started + [fresh[i] for i in ranked])

    def _step_s(self, pieces: list[tuple[list, int, int]]) -> float:
        if self.mixed_step == "sum":
            return self._decode_s() + sum(self._piece_s(done, n) for _, done, n in pieces)
        return chunked_step_s(self.model, len(self.running), self._context(),
                              [(done, n) for _, done, n in pieces], self.mixed_step_extra_s)

    def _context(self) -> int:
        return sum(r.input_len + r.output_len - left for r, left in self.running)

    def _decode_s(self) -> float:
        if not self.running:
            return 0.0
        return self.model.decode_step_s(len(self.running), self._context())

    def _piece_s(self, done: int, tokens: int) -> float:
        return self.model.prefill_s(done + tokens) - self.model.prefill_s(done)

    def _end_step(self, pieces: list[tuple[list, int, int]]) -> None:
        now = self.loop.now
        for entry in self.running:
            entry[1] -= 1
            if entry[1] == 0:  # its last token leaves as late as its first did
                entry[0].finished = now + self.model.prefill_base_s
        self.running = [entry for entry in self.running if entry[1] > 0]
        for entry, _, tokens in pieces:
            entry[1] += tokens
            if entry[1] == entry[0].input_len:
                self._prefilled(entry[0], now)
        self._step()

    def _prefilled(self, request: SimRequest, now: float) -> None:
        self.waiting.popleft()  # pieces go in the waiting order: it is the head
        request.prefill_done = now
        request.first_token = now + self.model.prefill_base_s
        if request.output_len > 1:
            self.running.append([request, request.output_len - 1])
        else:
            request.finished = request.first_token
