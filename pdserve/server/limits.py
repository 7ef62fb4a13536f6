"""HTTP limits shared by the server (``pdserve serve``) and the gateway: what one client may
send and hold, and the 4xx each excess gets.

- body size (``max_body_bytes``): aiohttp's ``client_max_size``; 413.
- request line or one header (``max_header_bytes``): aiohttp's ``max_line_size`` and
  ``max_field_size``; 400 in plain text naming the limit (aiohttp answers before any
  middleware runs).
- a body that does not arrive in time (``body_timeout_s``), a slow or stalled client: the
  middleware below; 408.
- an idle keep-alive connection (``idle_timeout_s``): aiohttp's ``keepalive_timeout``; closed.
- requests answered at once (``max_concurrent``), streams included: the middleware; 429.
- JSON nesting (``max_json_depth``): the middleware, before any parsing; 400.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.server import protocol as P

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


@dataclass(frozen=True)
class HTTPLimits:
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body (413 beyond)."""
    max_header_bytes: int = 16 * 1024
    """Longest request line and longest header (400 beyond)."""
    body_timeout_s: float = 30.0
    """A request body must be in within this long of the request's start (408 beyond)."""
    idle_timeout_s: float = 75.0
    """An idle keep-alive connection is closed after this long."""
    max_concurrent: int = 4096
    """Requests answered at once (streams included); more are refused with 429."""
    max_json_depth: int = 32
    """Deepest nesting of arrays and objects in a JSON body (400 beyond)."""

    @classmethod
    def of(cls, config: Any) -> HTTPLimits:
        """The limits a ``ServerConfig`` or ``GatewayConfig`` sets (the rest: defaults)."""
        return cls(max_body_bytes=config.max_request_bytes, body_timeout_s=config.body_timeout_s,
                   max_concurrent=config.max_concurrent_requests)

    def runner_options(self) -> dict[str, Any]:
        """Keyword arguments for ``web.AppRunner`` (passed on to aiohttp's parser)."""
        return {"max_line_size": self.max_header_bytes, "max_field_size": self.max_header_bytes,
                "keepalive_timeout": self.idle_timeout_s}

    def middleware(self):
        """Enforces the body timeout, the concurrency cap and the nesting depth on POSTs."""
        in_flight = 0

        @web.middleware
        async def limit(http: web.Request, handler) -> web.StreamResponse:
            nonlocal in_flight
            if http.method != "POST":
                return await handler(http)
            if in_flight >= self.max_concurrent:
                raise P.APIError(429, f"this server is answering {in_flight} requests, its "
                                 f"limit; retry shortly", code="too_many_requests")
            in_flight += 1
            try:
                self.check_depth(await self._read_body(http))
                return await handler(http)
            finally:
                in_flight -= 1

        return limit

    async def _read_body(self, http: web.Request) -> bytes:
        # Read here, under the deadline; the handler's own read() gets the cached bytes.
        try:
            return await asyncio.wait_for(http.read(), self.body_timeout_s)
        except TimeoutError:
            raise P.APIError(408, f"the request body did not arrive within "
                             f"{self.body_timeout_s:g} s", code="request_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            raise P.APIError(413, f"the request body is larger than {self.max_body_bytes} "
                             "bytes", code="request_too_large") from None

    def check_depth(self, raw: bytes) -> None:
        """400 if arrays and objects nest deeper than ``max_json_depth``; brackets inside
        strings do not count. Stops at the first bracket past the limit."""
        depth = 0
        for bracket in _BRACKETS.finditer(_STRINGS.sub(b"", raw)):
            depth += 1 if bracket.group() in (b"[", b"{") else -1
            if depth > self.max_json_depth:
                raise P.bad_request(f"the JSON body nests deeper than {self.max_json_depth} "
                                    "levels", code="json_too_deep")
