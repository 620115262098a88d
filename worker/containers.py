"""Where a live container byte stream starts and where its media fragments begin.

A WebM stream is an EBML header and a Segment whose Tracks come before the first Cluster; a
fragmented MP4 is `ftyp` and `moov` before the first `moof`. The bytes before the first
fragment (the init segment) are what a decoder needs to join the stream at any later fragment.
"""

MAX_INIT_SEGMENT_BYTES = 1024 * 1024  # a longer "header" is not kept

_WEBM_HEADER = bytes.fromhex("1a45dfa3")  # EBML
_WEBM_CLUSTER = bytes.fromhex("1f43b675")
_MP4_HEADER_BOXES = (b"ftyp", b"styp")
_MP4_FRAGMENT = b"moof"


def starts_stream(container_format: str, data: bytes) -> bool:
    """Whether `data` begins a new stream (it carries its own header)."""
    if container_format == "webm":
        return data.startswith(_WEBM_HEADER)
    return data[4:8] in _MP4_HEADER_BOXES


def first_fragment(container_format: str, data: bytes) -> int | None:
    """Offset of the first Cluster (WebM) or `moof` box (MP4) in `data`, or None when none starts in it."""
    if container_format == "webm":
        at = data.find(_WEBM_CLUSTER)
        return at if at >= 0 else None
    at = data.find(_MP4_FRAGMENT, 4)
    while at >= 0:
        size = int.from_bytes(data[at - 4 : at], "big")
        if size >= 16:  # a box header and at least one child header
            return at - 4
        at = data.find(_MP4_FRAGMENT, at + 1)
    return None
