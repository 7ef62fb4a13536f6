"""The gateway's HTTP server: the OpenAI routes clients use, health, metrics and the groups
it sees. ``pdserve gateway`` runs it."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal

from aiohttp import web

from pdserve.cluster.config import GatewayConfig
from pdserve.cluster.gateway import Gateway
from pdserve.cluster.ratio import RatioController
from pdserve.cluster.registry import Registry, make_registry
from pdserve.cluster.responses import GatewayResponses
from pdserve.server import protocol as P
from pdserve.server.cors import is_preflight
from pdserve.server.limits import HTTPLimits
from pdserve.server.metrics import CONTENT_TYPE

log = logging.getLogger("pdserve.gateway")
GATEWAY_KEY = web.AppKey("gateway", Gateway)


def build_gateway_app(gateway: Gateway) -> web.Application:
    limits = HTTPLimits.of(gateway.config)
    app = web.Application(client_max_size=limits.max_body_bytes,
                          middlewares=[_errors, _api_key, limits.middleware()])
    app[GATEWAY_KEY] = gateway
    app.router.add_post("/v1/completions", _forward("completions"))
    app.router.add_post("/v1/chat/completions", _forward("chat"))
    GatewayResponses(gateway, gateway.config.max_stored_responses).add_to(app)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    for path in ("/tokenize", "/detokenize"):
        app.router.add_post(path, _relayed(path))
    # Whole prompts and no decode: a prefill instance's work, tried first.
    for path in ("/v1/embeddings", *P.SCORE_PATHS, *P.RERANK_PATHS):
        app.router.add_post(path, _relayed(path, ("prefill", "decode")))
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/cluster/groups", _groups)
    gateway.config.allow_cross_origin(app)
    return app


def _forward(kind: str):
    async def handler(http: web.Request) -> web.StreamResponse:
        return await http.app[GATEWAY_KEY].forward(http, kind)

    return handler


def _relayed(path: str, roles: tuple[str, ...] = ("decode", "prefill")):
    async def handler(http: web.Request) -> web.Response:
        return await http.app[GATEWAY_KEY].relay(http, path, roles)

    return handler


@web.middleware
async def _errors(http: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(http)
    except P.APIError as exc:
        headers = dict(exc.headers)
        if exc.status in (429, 503):
            headers.setdefault("Retry-After", str(http.app[GATEWAY_KEY].config.retry_after))
        return web.Response(status=exc.status, body=P.dumps(exc.body()),
                            content_type="application/json", headers=headers)


@web.middleware
async def _api_key(http: web.Request, handler) -> web.StreamResponse:
    key = http.app[GATEWAY_KEY].config.api_key
    guarded = http.path.startswith(("/v1", "/v2")) or http.path in (
        "/tokenize", "/detokenize", "/score", "/rerank")
    if key and guarded and not is_preflight(http):
        given = http.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise P.APIError(401, "invalid or missing API key", code="invalid_api_key")
    return await handler(http)


async def _models(http: web.Request) -> web.Response:
    data = await http.app[GATEWAY_KEY].model_cards()
    return web.Response(body=P.dumps({"object": "list", "data": data}),
                        content_type="application/json")


async def _model(http: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: one model's card, as an instance gives it."""
    card = P.model_card(await http.app[GATEWAY_KEY].model_cards(), http.match_info["model"])
    return web.Response(body=P.dumps(card), content_type="application/json")


async def _health(http: web.Request) -> web.Response:
    """200 while some scenario has both a prefill and a decode instance."""
    sizes = http.app[GATEWAY_KEY].group_sizes()
    scenarios = {s for s, _ in sizes}
    ready = any(sizes[(s, "prefill")] and sizes[(s, "decode")] for s in scenarios)
    return web.Response(status=200 if ready else 503)


async def _metrics(http: web.Request) -> web.Response:
    return web.Response(body=http.app[GATEWAY_KEY].metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE})


async def _groups(http: web.Request) -> web.Response:
    gateway = http.app[GATEWAY_KEY]
    registry = gateway.registry
    groups = {s: {role: [{"instance_id": i.instance_id, "http": i.http, "kv": i.kv,
                          "tensor_parallel_size": i.tensor_parallel_size,
                          "in_flight": _load(gateway, role)[i.instance_id]}
                         for i in registry.instances(s, role)]
                  for role in ("prefill", "decode")}
              for s in registry.scenarios()}
    return web.Response(body=P.dumps({"object": "cluster.groups", "groups": groups}),
                        content_type="application/json")


def _load(gateway: Gateway, role: str):
    return gateway.prefill_load if role == "prefill" else gateway.decode_load


# ---- process life -------------------------------------------------------------------------


async def start_gateway(config: GatewayConfig, registry: Registry | None = None
                        ) -> tuple[web.AppRunner, Gateway, asyncio.Task | None]:
    """Starts serving; the caller keeps the loop running and calls ``stop_gateway``."""
    gateway = Gateway(registry or make_registry(config.registry), config)
    await gateway.start()
    runner = web.AppRunner(build_gateway_app(gateway), handler_cancellation=True,
                           access_log=None, shutdown_timeout=config.shutdown_timeout,
                           **HTTPLimits.of(config).runner_options())
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port,
                      ssl_context=config.ssl_context()).start()
    ratio = None
    if config.ratio_interval_s > 0:
        load = {"prefill": gateway.prefill_load, "decode": gateway.decode_load}
        controller = RatioController(gateway.registry, gateway.metrics, load)
        ratio = asyncio.ensure_future(controller.run(config.ratio_interval_s))
    log.info("gateway on %s://%s:%d, registry %s", "https" if config.ssl_certfile else "http",
             config.host, config.port, config.registry)
    return runner, gateway, ratio


async def stop_gateway(runner: web.AppRunner, gateway: Gateway,
                       ratio: asyncio.Task | None) -> None:
    if ratio is not None:
        ratio.cancel()
    await runner.cleanup()
    await gateway.close()


def run_gateway(config: GatewayConfig) -> None:
    """``pdserve gateway``: serves until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    async def main() -> None:
        runner, gateway, ratio = await start_gateway(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await stop_gateway(runner, gateway, ratio)
        gateway.registry.close()

    asyncio.run(main())
