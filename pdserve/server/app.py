"""The HTTP server: routes, middlewares (errors, API key, draining) and the process's life
from start-up to a clean SIGTERM shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from pdserve.model.generation_config import sampling_defaults
from pdserve.model.tokenizer import load_chat_template
from pdserve.server import protocol as P
from pdserve.server.auth import APIKeyFileError, is_authorized, load_api_keys
from pdserve.server.client import EngineClient, RestartPolicy
from pdserve.server.config import ServerConfig
from pdserve.server.cors import is_preflight
from pdserve.server.embeddings import EmbeddingRoutes
from pdserve.server.engine_process import DEFAULT_CORE
from pdserve.server.limits import HTTPLimits
from pdserve.server.metrics import CONTENT_TYPE, ServerMetrics
from pdserve.server.pd import PDRoutes
from pdserve.server.responses_routes import ResponsesRoutes
from pdserve.server.serving import OpenAIServing
from pdserve.server.stats_log import log_stats
from pdserve.server.tokenization import TokenizationRoutes
from pdserve.server.tool_calls import ToolSettings

logger = logging.getLogger("pdserve.server")

STATE_KEY = web.AppKey("state", object)
# Draining and in-flight counting apply here; user API keys guard all but /pd/, which has
# its own cluster secret (pdserve/server/pd.py).
GUARDED_PATHS = ("/v1", "/v2", "/pd/", "/tokenize", "/detokenize", "/invocations", "/score",
                 "/rerank")
API_KEY_PATHS = ("/v1", "/v2", "/tokenize", "/detokenize", "/invocations", "/score",
                 "/rerank", "/reset_prefix_cache")
SERVER_HEADER = "X-PDServe-Api-Server"
"""With --api-server-count > 1: which HTTP process (0 .. N-1) answered."""


@dataclass
class ServerState:
    client: EngineClient
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    api_keys: tuple[bytes, ...] = ()
    """Any of these is accepted as a bearer token; none: the routes are open."""
    model_names: tuple[str, ...] = ()
    created: int = field(default_factory=P.now_s)
    draining: bool = False
    active: int = 0  # /v1 requests being answered
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def healthy(self) -> bool:
        return self.client.alive and not self.draining


def build_app(client: EngineClient, config: ServerConfig,
              api_keys: tuple[bytes, ...] | None = None,
              sampling_defaults: dict[str, Any] | None = None,
              server_index: int = 0, created: int | None = None) -> web.Application:
    """``api_keys``: as ``load_api_keys`` gives them (read from ``config`` when None);
    ``sampling_defaults``: request defaults from the model's generation config;
    ``server_index``: which of ``config.api_server_count`` HTTP processes this is;
    ``created``: the model's ``created`` time in /v1/models (default: now)."""
    if api_keys is None:
        api_keys = load_api_keys(config.api_key, config.api_key_file)
    names = config.served_model_name or (client.model_name,)
    names = (names,) if isinstance(names, str) else tuple(names)  # ServerConfig(..., "name")
    # Several HTTP processes: request metrics are summed in the engine process.
    publish = client.publish_metrics if config.api_server_count > 1 else None
    metrics = ServerMetrics(lambda: client.stats, lambda: client.num_in_flight, names[0],
                            publish)
    state = ServerState(client, config, names[0], metrics, api_keys, model_names=tuple(names),
                        created=P.now_s() if created is None else created)
    state.idle.set()
    if config.chat_template is not None:
        client.tokenizer.chat_template = load_chat_template(config.chat_template)
    serving = OpenAIServing(client, client.tokenizer, names[0], metrics, config.log_requests,
                            tuple(names[1:]), sampling_defaults,
                            ToolSettings(config.enable_auto_tool_choice, config.tool_call_parser),
                            config.reasoning_parser)
    limits = HTTPLimits.of(config)
    app = web.Application(client_max_size=limits.max_body_bytes,
                          middlewares=[_errors, _api_key, _admission, limits.middleware()])
    app[STATE_KEY] = state
    if config.api_server_count > 1:
        app.on_response_prepare.append(_tag_server(str(server_index)))
    if config.enable_request_id_headers:
        app.on_response_prepare.append(_echo_request_id)
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_post("/v1/chat/completions", serving.chat)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/v1/engine/timeline", _timeline)
    app.router.add_get("/v1/engine/info", _engine_info)
    app.router.add_get("/health", _health)
    # SageMaker's routes, as vLLM serves them: /ping is /health, /invocations a generation.
    app.router.add_get("/ping", _health)
    app.router.add_post("/ping", _health)
    app.router.add_post("/invocations", serving.invocations)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    PDRoutes(serving, config.cluster_secret).add_to(app)
    TokenizationRoutes(serving).add_to(app)
    EmbeddingRoutes(serving).add_to(app)
    # Each HTTP process would keep its own responses: a continuation could miss its own.
    stored = config.max_stored_responses if config.api_server_count == 1 else 0
    ResponsesRoutes(serving, stored).add_to(app)
    config.allow_cross_origin(app)
    return app


def _state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]


def _tag_server(index: str):
    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[SERVER_HEADER] = index

    return tag


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``--enable-request-id-headers``: before the headers go out (streams too)."""
    response.headers[P.REQUEST_ID_HEADER] = (request.headers.get(P.REQUEST_ID_HEADER)
                                             or uuid.uuid4().hex)


# ---- middlewares --------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure leaves in the OpenAI error shape; none escapes as a bare 500 page."""
    try:
        return await handler(request)
    except P.APIError as exc:
        return _error_response(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error_response(request, P.APIError(exc.status, exc.reason))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - log it, answer 500, keep serving
        logger.exception("unhandled error on %s", request.path)
        return _error_response(request, P.APIError(500, f"internal error: {exc}"))


def _error_response(request: web.Request, exc: P.APIError) -> web.Response:
    state = _state(request)
    state.metrics.count_error(exc.status)
    headers = dict(exc.headers)
    if exc.status in (429, 503):
        headers.setdefault("Retry-After", str(state.config.retry_after))
    return web.Response(status=exc.status, body=P.dumps(exc.body()),
                        content_type="application/json", headers=headers)


@web.middleware
async def _api_key(request: web.Request, handler) -> web.StreamResponse:
    keys = _state(request).api_keys
    if keys and request.path.startswith(API_KEY_PATHS) and not is_preflight(request):
        if not is_authorized(request.headers.get("Authorization", ""), keys):
            raise P.APIError(401, "invalid or missing API key", code="invalid_api_key")
    return await handler(request)


@web.middleware
async def _admission(request: web.Request, handler) -> web.StreamResponse:
    """Refuses new work while draining or without an engine; counts what is in flight."""
    state = _state(request)
    if request.method != "POST" or not request.path.startswith(GUARDED_PATHS):
        return await handler(request)
    if state.draining:
        raise P.APIError(503, "the server is shutting down")
    if not state.client.alive:
        raise P.APIError(503, "the engine is not running")
    state.active += 1
    state.idle.clear()
    try:
        return await handler(request)
    finally:
        state.active -= 1
        if state.active == 0:
            state.idle.set()


# ---- small routes -------------------------------------------------------------------------


async def _models(request: web.Request) -> web.Response:
    state = _state(request)
    body = P.models_list(state.model_names or (state.model_name,), state.client.max_model_len,
                         state.created)
    return web.Response(body=P.dumps(body), content_type="application/json")


async def _model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (OpenAI's retrieve): one served name's card, else 404."""
    state = _state(request)
    cards = P.models_list(state.model_names or (state.model_name,),
                          state.client.max_model_len, state.created)["data"]
    card = P.model_card(cards, request.match_info["model"])
    return web.Response(body=P.dumps(card), content_type="application/json")


async def _timeline(request: web.Request) -> web.Response:
    """The engine's SM split history; ``since`` is a ``time.monotonic()`` value of this host,
    and ``now`` in the answer is one, so a client can ask for what happened after it."""
    since = _float_query(request, "since")
    entries = await _state(request).client.timeline(since)
    body = {"object": "engine.timeline", "now": time.monotonic(), "entries": entries}
    return web.Response(body=P.dumps(body), content_type="application/json")


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """Forgets the prefix cache's free blocks (``EngineCore.reset_prefix_cache``), as
    vLLM's route of that name and SGLang's ``/flush_cache``: benchmark runs that must not
    hit each other's prompts. Blocks that running requests hold stay cached (their
    contents are live and right); the answer counts both."""
    counts = await _state(request).client.reset_prefix_cache()
    if counts is None:
        raise P.APIError(501, "this engine keeps no prefix cache to reset")
    body = {"object": "prefix_cache.reset", **counts}
    return web.Response(body=P.dumps(body), content_type="application/json")


async def _engine_info(request: web.Request) -> web.Response:
    """What runs: schedule, attention backend, SM partitions (real or emulated), predictor,
    and counters (overlap, calibration) as of now. A stopped engine answers with what it
    said at start-up, marked so."""
    client = _state(request).client
    head = {"object": "engine.info", "engine_pid": client.engine_pid}
    try:
        body = {**head, **client.setup, **await client.describe()}
    except P.APIError:
        body = {**head, **client.setup, "as_of": "start-up (the engine is not running now)"}
    return web.Response(body=P.dumps(body), content_type="application/json")


def _float_query(request: web.Request, name: str) -> float | None:
    text = request.query.get(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise P.bad_request(f"'{name}' must be a finite number", param=name)
    return value


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if _state(request).healthy else 503)


async def _metrics(request: web.Request) -> web.Response:
    state = _state(request)
    if state.metrics.publish is not None:  # the sums over every HTTP process
        try:
            reply = await state.client.request_metrics()
        except P.APIError as exc:
            raise P.APIError(503, "the request metrics of all HTTP processes are summed in "
                             f"the engine process, which did not answer: {exc.message}"
                             ) from None
        state.metrics.show(reply.metrics, reply.others_in_flight)
    body = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# ---- process life -------------------------------------------------------------------------


class Lifecycle(Protocol):
    """Hooks for whoever announces this server elsewhere (a P/D group's registry)."""

    def started(self, client: EngineClient) -> None:
        """The server listens and the engine is loaded."""

    def stopping(self) -> None:
        """Shutdown began: called before draining, so no new work is routed here."""


def serve(engine_config: Any, config: ServerConfig, core_factory: str = DEFAULT_CORE,
          lifecycle: Lifecycle | None = None) -> None:
    """Runs the server until SIGTERM or SIGINT; returns once the engine process is gone."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:  # before the engine loads: a bad key file must not cost a model load
        api_keys = load_api_keys(config.api_key, config.api_key_file)
    except APIKeyFileError as exc:
        raise SystemExit(f"pdserve serve: {exc}") from None
    run_event_loop(_serve(engine_config, config, api_keys, core_factory, lifecycle))


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Runs ``main`` on uvloop when it is installed (the optional extra pdserve[uvloop]:
    less CPU per streamed chunk), on asyncio's own loop otherwise."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    logger.info("event loop: %s", "uvloop" if uvloop is not None else
                "asyncio (pip install 'pdserve[uvloop]' for uvloop)")
    (uvloop.run if uvloop is not None else asyncio.run)(main)


async def _serve(engine_config: Any, config: ServerConfig, api_keys: tuple[bytes, ...],
                 core_factory: str, lifecycle: Lifecycle | None) -> None:
    logger.info("starting the engine process")
    client = await EngineClient.start(engine_config, core_factory, config.engine_start_timeout,
                                      _restart_policy(config), config.api_server_count)
    model = engine_config.model
    defaults = sampling_defaults(model.generation_config, model.model)
    created = P.now_s()  # every HTTP process's /v1/models says the same
    workers = await _start_workers(client, config, api_keys, defaults, created)
    app = build_app(client, config, api_keys, defaults, created=created)
    state = app[STATE_KEY]
    runner = await listen(app, config)
    logger.info("serving '%s' on %s://%s:%d (max_model_len %d%s)", state.model_name,
                "https" if config.ssl_certfile else "http", config.host, config.port,
                client.max_model_len,
                f", {config.api_server_count} HTTP processes" if workers else "")
    if api_keys:
        logger.info("API key required on /v1 routes (%d key(s) accepted)", len(api_keys))
    stop, force = install_signals(workers.forward_signal if workers else None)
    stats_lines = start_stats_log(client, config)
    if lifecycle is not None:
        lifecycle.started(client)
    ends = [asyncio.ensure_future(stop.wait()), client.gave_up]
    await asyncio.wait(ends + ([workers.failed] if workers else []),
                       return_when=asyncio.FIRST_COMPLETED)
    if lifecycle is not None:
        lifecycle.stopping()
    if workers:
        workers.stop()
    await drain(state, config.shutdown_timeout, force)
    if stats_lines is not None:
        stats_lines.cancel()
    await runner.cleanup()
    if workers:
        await workers.join(config.shutdown_timeout)
    await client.shutdown()
    _exit_with_reason(client, workers)
    logger.info("stopped")


def start_stats_log(client: EngineClient, config: ServerConfig) -> asyncio.Future | None:
    """The periodic line of the engine's stats (``stats_log.py``), unless turned off."""
    if config.disable_log_stats:
        return None
    return asyncio.ensure_future(log_stats(lambda: client.stats, config.log_stats_interval_s,
                                           time.monotonic))


def _restart_policy(config: ServerConfig) -> RestartPolicy:
    if config.api_server_count == 1:
        return RestartPolicy(config.engine_restarts, config.engine_restart_backoff_s)
    if config.engine_restarts:
        logger.warning("engine restarts are off with --api-server-count %d: if the engine "
                       "process dies, the server stops (exit code 1)", config.api_server_count)
    return RestartPolicy(0, off_reason="restarts are off with --api-server-count > 1")


async def _start_workers(client: EngineClient, config: ServerConfig,
                         api_keys: tuple[bytes, ...], defaults: dict[str, Any], created: int
                         ) -> Any:
    """The other HTTP processes, listening once this returns (None with one process)."""
    if config.api_server_count == 1:
        return None
    from pdserve.server.workers import APIWorkers

    workers = APIWorkers(client.worker_pipes, config, api_keys, defaults, created)
    client.worker_pipes = []
    try:
        await workers.started(config.engine_start_timeout)
    except RuntimeError as exc:
        workers.kill()
        await client.shutdown()
        raise SystemExit(f"pdserve serve: {exc}") from None
    return workers


def _exit_with_reason(client: EngineClient, workers: Any) -> None:
    if client.gave_up.done():
        raise SystemExit(f"pdserve serve: {client.gave_up.result()}")
    if workers and workers.failed.done():
        raise SystemExit(f"pdserve serve: {workers.failed.result()}")


async def listen(app: web.Application, config: ServerConfig) -> web.AppRunner:
    """Serves ``app`` on the configured address (shared by every HTTP process when there
    are several)."""
    # handler_cancellation: a client that hangs up cancels its handler, whose cleanup
    # aborts the request and frees its KV blocks at once.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           **HTTPLimits.of(config).runner_options())
    await runner.setup()
    shared = {"reuse_port": True} if config.api_server_count > 1 else {}
    await web.TCPSite(runner, config.host, config.port, ssl_context=config.ssl_context(),
                      **shared).start()
    return runner


def install_signals(forward: Callable[[], None] | None = None,
                    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
                    ) -> tuple[asyncio.Event, asyncio.Event]:
    """First SIGTERM/SIGINT starts draining; a second one cuts the drain short. Each one is
    also passed on by ``forward`` (to the other HTTP processes)."""
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()
        if forward is not None:
            forward()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    return stop, force


async def drain(state: ServerState, timeout: float, force: asyncio.Event) -> None:
    state.draining = True
    logger.info("draining %d request(s) for up to %.0f s", state.active, timeout)
    start = time.monotonic()
    idle = asyncio.ensure_future(state.idle.wait())
    forced = asyncio.ensure_future(force.wait())
    await asyncio.wait([idle, forced], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if not state.idle.is_set():
        logger.warning("aborting %d request(s) after %.1f s", state.active,
                       time.monotonic() - start)
        state.client.abort_all("the server is shutting down")
        # Let the aborted handlers write their error answers before connections close.
        await asyncio.wait([idle], timeout=5.0)
    idle.cancel()
