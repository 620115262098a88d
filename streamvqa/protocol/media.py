"""What a session's media stream carries: typed entries, and the `frames` message format.

A media entry is a Redis stream entry whose `type` field is a MediaKind; its payload is raw
bytes in the field `data`. The gateway writes entries (`MediaEntry.fields`), the worker's ingest
reads them (`MediaEntry.read`); no other module spells a kind or a field.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import StrEnum


class MediaKind(StrEnum):
    """A media entry's `type`; the fields each kind has beside it are named here."""

    CONNECT = "connect"  # a stream socket took the stream: `format`, `connection`
    DATA = "data"  # container bytes, of an upload or a live stream: `data`
    FRAME = "frame"  # one `frames` message, its header and image: `data`
    END = "end"  # the client ended its media; an upload's end carries its size: `bytes`
    DISCONNECT = "disconnect"  # the stream socket went away (its client may come back): `connection`
    ABORT = "abort"  # the gateway gave up an unfinished upload (written by scripts.ABORT_UPLOAD_LUA)


@dataclass(frozen=True)
class MediaEntry:
    """One entry of a session's media stream."""

    kind: str  # a MediaKind; an entry read with another is the ingest's to refuse
    data: bytes = b""  # DATA, FRAME
    format: str | None = None  # CONNECT: webm, mp4 or frames
    connection: str | None = None  # CONNECT, DISCONNECT: the stream socket's id
    upload_bytes: int | None = None  # END of an upload: its size

    def fields(self) -> dict[str, bytes | str]:
        """The entry's Redis fields, `type` first; only those its kind has."""
        written: dict[str, bytes | str] = {"type": str(self.kind)}
        if self.kind in (MediaKind.DATA, MediaKind.FRAME):
            written["data"] = self.data
        if self.format is not None:
            written["format"] = self.format
        if self.connection is not None:
            written["connection"] = self.connection
        if self.upload_bytes is not None:
            written["bytes"] = str(self.upload_bytes)
        return written

    @classmethod
    def read(cls, fields: dict[bytes, bytes]) -> MediaEntry:
        """The entry whose Redis fields are `fields`."""
        media_format, connection, size = (fields.get(name) for name in (b"format", b"connection", b"bytes"))
        return cls(
            kind=fields.get(b"type", b"").decode(),
            data=fields.get(b"data", b""),
            format=None if media_format is None else media_format.decode(),
            connection=None if connection is None else connection.decode(),
            upload_bytes=None if size is None else int(size),
        )


# `frames` messages: an 8-byte header, the capture time in seconds as a little-endian IEEE 754
# double, then one JPEG, PNG or WebP image.
FRAME_HEADER_BYTES = 8
MAX_VIDEO_TIME_S = 7 * 24 * 3600.0
IMAGE_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF")  # JPEG, PNG, WebP (RIFF....WEBP)


def frame_message(time_s: float, image: bytes) -> bytes:
    """A `frames` message: the header, then the image."""
    return struct.pack("<d", time_s) + image


def parse_frame_header(message: bytes) -> float:
    """The capture time of a `frames` message; ValueError, for the client, when it is not one."""
    if len(message) <= FRAME_HEADER_BYTES:
        raise ValueError(f"a frame message is an {FRAME_HEADER_BYTES}-byte time and an image; got {len(message)} bytes")
    (time_s,) = struct.unpack_from("<d", message)
    if not (math.isfinite(time_s) and 0 <= time_s <= MAX_VIDEO_TIME_S):
        raise ValueError(f"a frame's time must be seconds from 0 to {MAX_VIDEO_TIME_S:.0f}; got {time_s}")
    image = message[FRAME_HEADER_BYTES:]
    if not (image.startswith(IMAGE_SIGNATURES[:2]) or (image.startswith(b"RIFF") and image[8:12] == b"WEBP")):
        raise ValueError("a frame's image must be JPEG, PNG or WebP")
    return time_s
