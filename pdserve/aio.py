"""Asyncio helpers the server and the gateway share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any


async def gather_or_cancel(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """The awaitables' results, run at once; if one fails the others are cancelled (and
    awaited) before the error goes on, so none keeps running for an answer already given
    up."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
