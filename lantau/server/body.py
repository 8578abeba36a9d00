"""Reading a request body for every HTTP route: refused past the cap while it streams in (a
huge or endless upload costs at most the cap), then gzip or deflate undone, also capped."""

from __future__ import annotations

import zlib

from starlette.requests import Request


class RequestBodyError(Exception):
    """A body the server will not read: too large (413) or badly encoded (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused past `max_bytes` before it is all read, and after decompression."""
    too_large = RequestBodyError(413, f"request body exceeds {max_bytes} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding")
    if encoding not in ("gzip", "deflate"):
        return body
    # 32 + MAX_WBITS: a gzip or zlib header, both of which tritonclient's options send
    decompressor = zlib.decompressobj(32 + zlib.MAX_WBITS)
    try:
        body = decompressor.decompress(body, max_bytes + 1)
    except zlib.error as e:
        raise RequestBodyError(400, f"bad {encoding} body: {e}") from None
    if len(body) > max_bytes or decompressor.unconsumed_tail:
        raise too_large
    return body
