"""An upload's file bytes as they arrive, from a raw body or the first file of a multipart form."""

from collections.abc import AsyncIterator

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from app.errors import ApiError
from streamvqa.protocol import MEDIA_CHUNK_BYTES


def file_chunks(request: Request) -> AsyncIterator[bytes]:
    """The uploaded file in chunks of MEDIA_CHUNK_BYTES (the last one shorter); nothing is
    buffered whole. Headers are checked now, the body as it streams."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data":
        return _rechunk(request.stream())
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "bad_multipart", "multipart upload without a boundary")
    return _rechunk(_multipart_file(request, boundary))


async def _rechunk(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    buffer = bytearray()
    async for piece in body:
        buffer += piece
        while len(buffer) >= MEDIA_CHUNK_BYTES:
            yield bytes(buffer[:MEDIA_CHUNK_BYTES])
            del buffer[:MEDIA_CHUNK_BYTES]
    if buffer:
        yield bytes(buffer)


async def _multipart_file(request: Request, boundary: bytes) -> AsyncIterator[bytes]:
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
    async for piece in request.stream():
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
