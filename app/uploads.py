"""An upload's file bytes as they arrive, from a raw body or the first file of a multipart form."""

import asyncio
import time
from collections.abc import AsyncIterator

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from app.errors import CLOSE, ApiError
from streamvqa.protocol import MEDIA_CHUNK_BYTES


RATE_WINDOW_S = 10.0  # an upload's rate is checked over each such span of waiting for the client


def file_chunks(request: Request, min_bytes_per_s: int = 0) -> AsyncIterator[bytes]:
    """The uploaded file in chunks of MEDIA_CHUNK_BYTES (the last one shorter); nothing is
    buffered whole. Headers are checked now, the body as it streams; a client sending less
    than `min_bytes_per_s` is refused (408)."""
    body = _paced(request.stream(), min_bytes_per_s) if min_bytes_per_s else request.stream()
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data":
        return _rechunk(body)
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "bad_multipart", "multipart upload without a boundary")
    return _rechunk(_multipart_file(body, boundary))


async def _paced(body: AsyncIterator[bytes], min_bytes_per_s: int) -> AsyncIterator[bytes]:
    """The body's pieces; ApiError 408 once, over RATE_WINDOW_S of waiting for the client (time
    the consumer spends, e.g. waiting for a slow worker, does not count), fewer than
    `min_bytes_per_s` bytes a second came."""
    pieces = aiter(body)
    waited_s, received = 0.0, 0
    arriving: asyncio.Task | None = None
    try:
        while True:
            arriving = arriving or asyncio.ensure_future(anext(pieces))
            started = time.monotonic()
            await asyncio.wait({arriving}, timeout=RATE_WINDOW_S - waited_s)
            waited_s += time.monotonic() - started
            if arriving.done():
                try:
                    piece = arriving.result()
                except StopAsyncIteration:
                    return
                arriving = None
                received += len(piece)
                yield piece
            if waited_s >= RATE_WINDOW_S:
                if received < min_bytes_per_s * waited_s:
                    raise ApiError(
                        408, "upload_too_slow",
                        f"the upload sent {received} bytes in {waited_s:.0f} s; at least {min_bytes_per_s} bytes a second are needed",
                        headers=CLOSE,
                    )
                waited_s, received = 0.0, 0
    finally:
        if arriving is not None and not arriving.done():
            arriving.cancel()


async def _rechunk(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    buffer = bytearray()
    async for piece in body:
        buffer += piece
        while len(buffer) >= MEDIA_CHUNK_BYTES:
            yield bytes(buffer[:MEDIA_CHUNK_BYTES])
            del buffer[:MEDIA_CHUNK_BYTES]
    if buffer:
        yield bytes(buffer)


async def _multipart_file(body: AsyncIterator[bytes], boundary: bytes) -> AsyncIterator[bytes]:
    parsed: list[bytes] = []
    part = {"headers": b"", "is_file": False, "files_seen": 0}

    def on_part_begin() -> None:
        part["headers"] = b""
        part["is_file"] = False

    def on_header_value(data: bytes, start: int, end: int) -> None:
        part["headers"] += data[start:end].lower() + b"\n"

    def on_headers_finished() -> None:
        part["is_file"] = b"filename=" in part["headers"] and part["files_seen"] == 0
        part["files_seen"] += part["is_file"]

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part["is_file"]:
            parsed.append(data[start:end])

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_value": on_header_value,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
        },
    )
    async for piece in body:
        try:
            parser.write(piece)
        except Exception as err:  # python-multipart raises its own parse errors
            raise ApiError(400, "bad_multipart", f"malformed multipart body: {err}") from err
        if parsed:
            yield b"".join(parsed)
            parsed.clear()
    parser.finalize()
    if not part["files_seen"]:
        raise ApiError(400, "no_file", "the multipart form has no file part")
