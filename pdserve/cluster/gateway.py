"""The gateway: one OpenAI-compatible front for P/D groups (P/D-Serve).

Per request: pick the scenario (a header, else the default), pick the decode instance of
that scenario's group with the fewest streams from here, then offer the prefill to the
group's prefill instances, least busy first. A prefill instance that could not start it in
time answers 429 at once (``pdserve/server/pd.py``); the gateway offers it to the next one.
When all refuse, the request waits in line here (first come, first served) and is offered
again as soon as a prefill this gateway placed ends, or after ``retry_poll_ms``, until
``max_wait_s`` - it waits where every instance is a candidate, never blindly in one
instance's queue. The chosen prefill instance ships the
KV straight to the decode instance; the gateway then asks the decode instance for the
answer and relays its bytes (streamed or not) unchanged.

``--dispatch least-connections`` and ``round-robin`` are the blind baselines P/D-Serve
compares against: the gateway places each prefill by its own count of prefills in flight,
or in turn, and the instance queues whatever it gets.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.cluster.config import GatewayConfig
from pdserve.cluster.metrics import GatewayMetrics
from pdserve.cluster.registry import Instance, Registry
from pdserve.server import protocol as P

log = logging.getLogger("pdserve.gateway")

DISPATCH = ("on-demand", "least-connections", "round-robin")
RELAYED_ERRORS = (400, 401, 404, 413)  # the request itself is wrong: no other instance helps
INSTANCE_COOLDOWN_S = 5.0  # an instance that failed to answer is skipped this long


@dataclass
class Prefilled:
    instance: Instance
    answer: dict[str, Any]


class Gateway:
    def __init__(self, registry: Registry, config: GatewayConfig) -> None:
        if config.dispatch not in DISPATCH:
            raise ValueError(f"--dispatch must be one of {', '.join(DISPATCH)}, "
                             f"not {config.dispatch!r}")
        self.registry = registry
        self.config = config
        self.metrics = GatewayMetrics()
        self.prefill_load: Counter[str] = Counter()  # prefills in flight, by instance id
        self.decode_load: Counter[str] = Counter()  # answers being relayed, by instance id
        self._failed_at: dict[str, float] = {}
        self._turn = 0  # round-robin position
        self._lines: dict[str, WaitLine] = {}  # refused requests, by scenario
        self._session: aiohttp.ClientSession | None = None
        self._model_lens: dict[str, int] = {}  # max_model_len, by instance id

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout)
        connector = aiohttp.TCPConnector(limit=0)  # every stream holds a connection
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- one request --------------------------------------------------------------------

    async def forward(self, http: web.Request, kind: str) -> web.StreamResponse:
        start = time.monotonic()
        body = P.parse_json_body(await http.read())
        scenario = self._scenario(http)
        decode = self._pick_decode(scenario)
        transfer_id = uuid.uuid4().hex
        # The ratio controller's window follows each request through prefill and decode.
        self.metrics.arrived(scenario)
        try:
            prefilled = await self._prefill(scenario, kind, body, transfer_id, decode, start)
        except P.APIError as exc:
            if exc.status in RELAYED_ERRORS:  # the request's own fault, not load
                self.metrics.withdrawn(scenario)
            raise
        self.metrics.prefilled(scenario, time.monotonic() - start)
        try:
            return await self._relay_decode(http, kind, body, transfer_id, decode, prefilled,
                                            scenario, start)
        finally:
            self.metrics.decode_ended(scenario)

    def _scenario(self, http: web.Request) -> str:
        scenario = http.headers.get(self.config.scenario_header, self.config.default_scenario)
        try:
            self.registry.instances(scenario, "decode")
        except ValueError as exc:  # not a name the registry can hold
            raise P.bad_request(f"bad {self.config.scenario_header} header: {exc}") from None
        return scenario

    def _pick_decode(self, scenario: str) -> Instance:
        candidates = self._live(scenario, "decode")
        if not candidates:
            raise P.APIError(503, f"no decode instance serves scenario '{scenario}'")
        return min(candidates, key=lambda i: (self.decode_load[i.instance_id], i.instance_id))

    def _live(self, scenario: str, role: str) -> list[Instance]:
        now = time.monotonic()
        return [i for i in self.registry.instances(scenario, role)
                if now - self._failed_at.get(i.instance_id, -1e9) > INSTANCE_COOLDOWN_S]

    async def _prefill(self, scenario: str, kind: str, body: dict, transfer_id: str,
                       decode: Instance, start: float) -> Prefilled:
        """Offers the prefill round the group until one instance takes it. Refused requests
        wait in line at the gateway, first come first served, and a newcomer queues behind
        them rather than jumping ahead."""
        line = self._lines.setdefault(scenario, WaitLine())
        poll_s = self.config.retry_poll_ms / 1e3
        if len(line):
            await line.wait(poll_s, first=False)
        for round_number in itertools.count():
            for instance in self._prefill_order(scenario):
                answer = await self._offer(instance, kind, body, transfer_id, decode, start)
                if answer is not None:
                    return Prefilled(instance, answer)
            if round_number == 0:
                self.metrics.count_refused_request(scenario)
            if time.monotonic() - start + poll_s > self.config.max_wait_s:
                self.metrics.count_unserved(scenario)
                raise P.APIError(503, f"every prefill instance of scenario '{scenario}' stayed "
                                 f"busy for {self.config.max_wait_s:.0f} s")
            await line.wait(poll_s, first=True)

    def _prefill_order(self, scenario: str) -> list[Instance]:
        candidates = self._live(scenario, "prefill")
        if not candidates and not self.registry.instances(scenario, "prefill"):
            raise P.APIError(503, f"no prefill instance serves scenario '{scenario}'")
        self._turn += 1
        return order_prefill(candidates, self.config.dispatch, self.prefill_load, self._turn)

    async def _offer(self, instance: Instance, kind: str, body: dict, transfer_id: str,
                     decode: Instance, start: float) -> dict[str, Any] | None:
        """The prefill's answer, or None if this instance refused or failed."""
        offer = {"kind": kind, "request": body, "transfer_id": transfer_id,
                 "kv_target": decode.kv, "ttft_budget_ms": self._ttft_budget_ms(start)}
        self.prefill_load[instance.instance_id] += 1
        try:
            async with self._session.post(f"http://{instance.http}/pd/prefill", json=offer,
                                          headers=self._headers()) as resp:
                data = await resp.read()
                return self._prefill_answer(instance, resp.status, data)
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("prefill instance %s failed: %s", instance.instance_id, exc)
            self._failed_at[instance.instance_id] = time.monotonic()
            return None
        finally:
            self.prefill_load[instance.instance_id] -= 1

    def _prefill_ended(self, instance: Instance) -> None:
        """A prefill this gateway placed is done: its instance has room for the next one."""
        line = self._lines.get(instance.scenario)
        if line is not None:
            line.wake_one()

    def _ttft_budget_ms(self, start: float) -> float | None:
        """What is left of the TTFT SLO; None (never refuse) when dispatch is blind."""
        if self.config.dispatch != "on-demand":
            return None
        return max(0.0, self.config.ttft_slo_ms - (time.monotonic() - start) * 1e3)

    def _prefill_answer(self, instance: Instance, status: int, data: bytes
                        ) -> dict[str, Any] | None:
        if status != 429:
            self._prefill_ended(instance)  # taken and finished (or failed): room again
        if status == 200:
            return P.parse_json_body(data)
        if status in RELAYED_ERRORS:
            raise _relayed_error(status, data)
        if status == 429:
            self.metrics.count_rejection(instance.instance_id)
        else:
            log.warning("prefill instance %s answered %d", instance.instance_id, status)
            self._failed_at[instance.instance_id] = time.monotonic()
        return None

    async def _relay_decode(self, http: web.Request, kind: str, body: dict, transfer_id: str,
                            decode: Instance, prefilled: Prefilled, scenario: str,
                            start: float) -> web.StreamResponse:
        answer = prefilled.answer
        ask = {"kind": kind, "request": body, "transfer_id": transfer_id,
               "first_token": answer["first_token"],
               "first_logprob": answer.get("first_logprob"),
               "num_cached_tokens": answer.get("num_cached_tokens", 0)}
        self.decode_load[decode.instance_id] += 1
        try:
            async with self._session.post(f"http://{decode.http}/pd/decode", json=ask,
                                          headers=self._headers()) as resp:
                return await self._relay(http, resp, decode, scenario, start)
        except (aiohttp.ClientError, OSError) as exc:  # before any byte of the answer
            self._failed_at[decode.instance_id] = time.monotonic()
            raise P.APIError(503, f"decode instance {decode.instance_id} failed: {exc}") from None
        finally:
            self.decode_load[decode.instance_id] -= 1

    async def _relay(self, http: web.Request, resp: aiohttp.ClientResponse, decode: Instance,
                     scenario: str, start: float) -> web.StreamResponse:
        out = web.StreamResponse(status=resp.status, headers=_relay_headers(resp))
        first = None
        try:
            async for data in resp.content.iter_any():
                if first is None:
                    first = time.monotonic()
                    await out.prepare(http)
                await out.write(data)
        except (aiohttp.ClientError, OSError) as exc:
            if first is None:
                raise
            await self._cut_short(out, decode, exc)
            return out
        if first is None:
            await out.prepare(http)
        await out.write_eof()
        end = time.monotonic()
        self.metrics.answered(scenario, resp.status, (first or end) - start, end - start,
                              start)
        return out

    async def _cut_short(self, out: web.StreamResponse, decode: Instance,
                         exc: BaseException) -> None:
        """The decode instance failed mid-answer: a stream ends with an error event, as a
        server's own failure mid-stream would (headers are already out)."""
        log.warning("decode instance %s failed mid-answer: %s", decode.instance_id, exc)
        self._failed_at[decode.instance_id] = time.monotonic()
        error = P.APIError(503, f"decode instance {decode.instance_id} failed mid-answer")
        if out.content_type == "text/event-stream":
            await out.write(P.sse(error.body()) + P.SSE_DONE)
        await out.write_eof()

    def _headers(self) -> dict[str, str]:
        key = self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ---- what the group looks like ------------------------------------------------------

    def models(self) -> list[str]:
        names = {i.model for s in self.registry.scenarios() for role in ("prefill", "decode")
                 for i in self.registry.instances(s, role) if i.model}
        return sorted(names)

    async def model_cards(self) -> list[dict]:
        """``/v1/models``: each served model with its ``max_model_len``, as one instance
        lists it; the smallest when instances differ, so a request that fits it fits all."""
        created = P.now_s()
        cards = []
        for name in self.models():
            lengths = [await self._max_model_len(i) for i in self._instances_of(name)]
            known = [n for n in lengths if n is not None]
            if not known:
                raise P.APIError(503, f"no instance of model '{name}' answered /v1/models")
            cards.append({"id": name, "object": "model", "created": created,
                          "owned_by": "pdserve", "root": name, "max_model_len": min(known)})
        return cards

    def _instances_of(self, model: str) -> list[Instance]:
        return [i for s in self.registry.scenarios() for role in ("prefill", "decode")
                for i in self.registry.instances(s, role) if i.model == model]

    async def _max_model_len(self, instance: Instance) -> int | None:
        """The instance's own ``/v1/models`` answer (kept: it never changes while the
        instance lives); None if it does not answer."""
        known = self._model_lens.get(instance.instance_id)
        if known is not None:
            return known
        try:
            async with self._session.get(f"http://{instance.http}/v1/models",
                                         headers=self._headers(),
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                body = await resp.json() if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("instance %s did not list its models: %s", instance.instance_id, exc)
            return None
        lengths = [card.get("max_model_len") for card in body.get("data", [])
                   if card.get("id") == instance.model]
        if lengths and isinstance(lengths[0], int):
            self._model_lens[instance.instance_id] = lengths[0]
            return lengths[0]
        return None

    def group_sizes(self) -> dict[tuple[str, str], int]:
        return {(s, role): len(self.registry.instances(s, role))
                for s in self.registry.scenarios() for role in ("prefill", "decode")}


def order_prefill(candidates: list[Instance], dispatch: str, load: Counter[str],
                  turn: int) -> list[Instance]:
    """The order in which a request is offered to prefill instances: in turn for
    round-robin, else fewest prefills in flight from this gateway first."""
    if dispatch == "round-robin" and candidates:
        start = turn % len(candidates)
        return candidates[start:] + candidates[:start]
    return sorted(candidates, key=lambda i: (load[i.instance_id], i.instance_id))


class WaitLine:
    """Requests waiting for a prefill instance to take them. One is woken each time a
    prefill placed by this gateway ends; each also looks again after ``timeout_s`` (room
    freed by requests from elsewhere)."""

    def __init__(self) -> None:
        self._waiting: deque[asyncio.Future] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(self, timeout_s: float, first: bool) -> None:
        """Waits to be woken or for ``timeout_s``; ``first`` keeps the head of the line."""
        future = asyncio.get_running_loop().create_future()
        (self._waiting.appendleft if first else self._waiting.append)(future)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            pass
        finally:
            if future in self._waiting:
                self._waiting.remove(future)

    def wake_one(self) -> None:
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_result(None)
                return


def _relay_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    keep = ("Content-Type", "Cache-Control", "Retry-After")
    return {k: resp.headers[k] for k in keep if k in resp.headers}


def _relayed_error(status: int, data: bytes) -> P.APIError:
    try:
        message = P.parse_json_body(data)["error"]["message"]
    except (P.APIError, KeyError, TypeError):
        message = data.decode(errors="replace")[:500]
    return P.APIError(status, message)
