"""API keys: from ``--api-key``, the ``PDSERVE_API_KEY`` environment variable and
``--api-key-file`` (one per line). Keys are compared in constant time and never logged."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

API_KEY_ENV = "PDSERVE_API_KEY"


class APIKeyFileError(ValueError):
    """The key file cannot be read or holds no key: the server must not start keyless."""


def load_api_keys(api_key: str | None, api_key_file: str | None,
                  environ: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """Every accepted key; empty when none is configured (the routes are then open)."""
    keys = [api_key, environ.get(API_KEY_ENV)]
    if api_key_file:
        keys += _read_key_file(api_key_file)
    return tuple(dict.fromkeys(k.encode() for k in keys if k))


def _read_key_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except (OSError, UnicodeDecodeError) as exc:
        raise APIKeyFileError(f"cannot read the API key file {path}: {exc}") from None
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise APIKeyFileError(f"the API key file {path} holds no key")
    return keys


def is_authorized(header: str, keys: tuple[bytes, ...]) -> bool:
    """Whether an ``Authorization`` header carries one of ``keys``. Every key is compared
    (``hmac.compare_digest``), so the time taken does not tell which one nearly matched."""
    scheme, _, given = header.partition(" ")
    token = given.strip().encode() if scheme.lower() == "bearer" else b""
    matches = [hmac.compare_digest(token, key) for key in keys]
    return any(matches)
