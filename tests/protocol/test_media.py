"""Media stream entries: what the gateway writes is what the worker reads, field by field."""

import pytest

from streamvqa.protocol import MediaEntry, MediaKind, frame_message, parse_frame_header

JPEG = b"\xff\xd8\xff" + b"\x00" * 16


@pytest.mark.parametrize(
    ("entry", "fields"),
    [
        (MediaEntry(MediaKind.CONNECT, format="webm", connection="c1"),
         {"type": "connect", "format": "webm", "connection": "c1"}),
        (MediaEntry(MediaKind.DATA, data=b"\x1a\x45"), {"type": "data", "data": b"\x1a\x45"}),
        (MediaEntry(MediaKind.DATA, data=b""), {"type": "data", "data": b""}),
        (MediaEntry(MediaKind.FRAME, data=frame_message(1.5, JPEG)), {"type": "frame", "data": frame_message(1.5, JPEG)}),
        (MediaEntry(MediaKind.END), {"type": "end"}),
        (MediaEntry(MediaKind.END, upload_bytes=1234), {"type": "end", "bytes": "1234"}),
        (MediaEntry(MediaKind.DISCONNECT, connection="c1"), {"type": "disconnect", "connection": "c1"}),
    ],
)
def test_an_entry_is_written_with_only_its_kind_s_fields_and_read_back_whole(entry, fields):
    assert entry.fields() == fields
    assert list(entry.fields())[0] == "type"
    read = MediaEntry.read({name.encode(): value if isinstance(value, bytes) else value.encode() for name, value in fields.items()})
    assert read == entry


def test_a_frame_entry_carries_its_time_only_in_its_header():
    entry = MediaEntry(MediaKind.FRAME, data=frame_message(2.25, JPEG))
    assert set(entry.fields()) == {"type", "data"}
    assert parse_frame_header(entry.data) == 2.25


def test_an_unknown_kind_is_read_as_it_is_for_the_ingest_to_refuse():
    assert MediaEntry.read({b"type": b"video"}).kind == "video"
    assert MediaEntry.read({}).kind == ""
