"""Where a live container byte stream starts and where its media fragments begin; and what a
file's own structure says of a file cut short, where its header states no length or cannot be read.

A WebM stream is an EBML header and a Segment whose Tracks come before the first Cluster; a
fragmented MP4 is `ftyp` and `moov` before the first `moof`. The bytes before the first
fragment (the init segment) are what a decoder needs to join the stream at any later fragment.

A file cut part-way (a download or copy that stopped) shows it where its container is made of
fixed-size packets (MPEG-TS: 188 bytes, 192 in an M2TS, 204 with error correction), which states
no length: its last packet is incomplete; and in an MP4 or MOV that keeps its index (`moov`) at
its end: the index is not there, and no frame can be found without it.
"""

from typing import BinaryIO

MAX_INIT_SEGMENT_BYTES = 1024 * 1024  # a longer "header" is not kept
TS_SYNC = 0x47  # the first byte of every MPEG-TS packet
TS_PACKET_LAYOUTS = ((188, 0), (192, 4), (204, 0))  # (packet bytes, where its sync byte is) of MPEG-TS, M2TS, TS with FEC
TS_PACKETS_CHECKED = 8  # packets whose sync bytes must agree before a layout is taken as the file's
MP4_FIRST_BOXES = (b"ftyp", b"wide", b"free", b"skip", b"mdat")  # what an MP4's or a MOV's first box may be
MP4_MAX_BOXES = 4096  # top-level boxes looked at, at most

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


def ts_ends_mid_packet(head: bytes, size: int) -> bool:
    """Whether an MPEG-TS file of `size` bytes, which begins with `head` (TS_PACKETS_CHECKED
    packets or more), ends inside a packet: it was cut short."""
    for packet, sync_at in TS_PACKET_LAYOUTS:
        starts = range(sync_at, min(len(head), packet * TS_PACKETS_CHECKED), packet)
        if len(starts) > 1 and all(head[at] == TS_SYNC for at in starts):
            return size % packet != 0
    return False  # not a layout it knows: it says nothing


def mp4_index_missing(file: BinaryIO, size: int) -> bool:
    """Whether a file of `size` bytes is an MP4 or MOV (by its first box) whose top-level boxes
    hold no whole `moov`, the index without which no frame can be found: a file whose index comes
    at its end, cut short before it or inside it (or never finished)."""
    offset = 0
    for _ in range(MP4_MAX_BOXES):
        if offset + 8 > size:
            return True
        file.seek(offset)
        header = file.read(16)
        box_bytes, kind = int.from_bytes(header[:4], "big"), header[4:8]
        if offset == 0 and kind not in MP4_FIRST_BOXES:
            return False
        if box_bytes == 1:  # its size in the next 8 bytes
            box_bytes = int.from_bytes(header[8:16], "big")
        elif box_bytes == 0:  # it runs to the end of the file
            box_bytes = size - offset
        if box_bytes < 8:
            return False  # not boxes at all
        if kind == b"moov":
            return offset + box_bytes > size  # there, unless cut inside it
        offset += box_bytes
    return False
