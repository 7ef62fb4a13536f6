"""Cross-origin requests (CORS), as vLLM's server allows them: a page served from another
origin may call the API from a browser, its preflight ``OPTIONS`` answered for every route
but the internal ``/pd/`` ones (aiohttp-cors). The server and the gateway take the same
flags (``CrossOriginConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from pdserve.config import doc

INTERNAL_PREFIXES = ("/pd/",)


@dataclass(frozen=True)
class CrossOriginConfig:
    allowed_origins: tuple[str, ...] = doc(("*",), "Origins whose browser pages may call "
                                          "the API (CORS); * allows any, as vLLM.")
    allow_credentials: bool = doc(False, "Cross-origin requests may carry credentials "
                                  "(cookies, HTTP authentication).")
    allowed_methods: tuple[str, ...] = doc(("*",), "HTTP methods cross-origin requests may "
                                           "use; * allows any.")
    allowed_headers: tuple[str, ...] = doc(("*",), "Request headers cross-origin requests "
                                           "may send; * allows any.")

    def allow_cross_origin(self, app: web.Application) -> None:
        """Answers cross-origin requests from ``allowed_origins`` on every route added so
        far but the internal ones."""
        aiohttp_cors = cors_library()
        options = aiohttp_cors.ResourceOptions(
            allow_credentials=self.allow_credentials, expose_headers="*",
            allow_methods="*" if "*" in self.allowed_methods else list(self.allowed_methods),
            allow_headers="*" if "*" in self.allowed_headers else list(self.allowed_headers))
        cors = aiohttp_cors.setup(app, defaults={o: options for o in self.allowed_origins})
        for route in list(app.router.routes()):
            if not route.resource.canonical.startswith(INTERNAL_PREFIXES):
                cors.add(route)


def is_preflight(request: web.Request) -> bool:
    """A browser's CORS preflight: it carries no credentials, it asks what a call may send
    (API keys are checked on the call itself)."""
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


def cors_library():
    """aiohttp-cors, a dependency of pdserve: one clear line where an install lacks it."""
    try:
        import aiohttp_cors
    except ImportError:
        raise RuntimeError("aiohttp-cors is not installed (pip install aiohttp-cors, a "
                           "dependency of pdserve): the server answers cross-origin "
                           "requests with it") from None
    return aiohttp_cors

