"""Cross-origin requests (CORS), as vLLM's server allows them: a page served from another
origin may call the API from a browser, its preflight ``OPTIONS`` answered for every route
but the internal ``/pd/`` ones (aiohttp-cors)."""

from __future__ import annotations

from aiohttp import web

INTERNAL_PREFIXES = ("/pd/",)


def allow_cross_origin(app: web.Application, origins: tuple[str, ...], credentials: bool,
                       methods: tuple[str, ...], headers: tuple[str, ...]) -> None:
    """Answers cross-origin requests from ``origins`` (``*``: any) on every route added so
    far. ``*`` in ``methods`` or ``headers``: any."""
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(
        allow_credentials=credentials, expose_headers="*",
        allow_methods="*" if "*" in methods else list(methods),
        allow_headers="*" if "*" in headers else list(headers))
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in list(app.router.routes()):
        if not route.resource.canonical.startswith(INTERNAL_PREFIXES):
            cors.add(route)
