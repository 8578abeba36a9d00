"""API keys, for the HTTP routes (an ASGI middleware in app.py) and the gRPC methods (an
interceptor in kserve_grpc.py): `Authorization: Bearer KEY` or `x-api-key: KEY`."""

from __future__ import annotations

import hmac
from collections.abc import Callable


def presented_key(get: Callable[[str], str | None]) -> str:
    """The key a request presents; `get` reads a header (or gRPC metadata) by lowercase name."""
    auth = get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return get("x-api-key") or ""


def is_authorized(key: str, keys: tuple[str, ...]) -> bool:
    # NOTE: compare against every key in constant time: no early exit leaks which matched
    given = key.encode()
    matches = [hmac.compare_digest(given, k.encode()) for k in keys]
    return any(matches)
