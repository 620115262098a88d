"""Uploaded files in every common container, and broken ones, through the real upload path."""

import pytest

from tests.app.test_stream import _audio_only_webm
from tests.media import cut_before_frame, faststart_mp4, file_bytes
from tests.support import sample_video, sse_events


@pytest.mark.parametrize("container", ["mp4", "mov", "mkv", "webm", "avi", "ts"])
def test_each_container_gives_its_frames(client, container):
    client.create(fps=2)
    data = file_bytes(container, 3.0)  # 3 s at 10 frames per second
    assert client.upload(data).status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert session["state"] == "ingested", session["error"]
    assert (session["frames_ingested"], session["video_time_s"]) == (6, 2.5)
    assert (session["upload_bytes"], session["media_duration_s"]) == (len(data), 3.0)


def test_the_carphone_sample_gives_eight_frames(client):
    client.create(fps=2)
    assert client.upload(sample_video("carphone_pristine.mp4").read_bytes()).status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"], session["video_time_s"]) == ("ingested", 8, 3.503)  # 29.97 fps: frame 105 is at 3.5035 s


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (file_bytes("mp4", 3.0)[:2000], "the file is incomplete: it ends before its index"),  # its index at its end
        (_audio_only_webm(), "the media has no video stream"),
    ],
    ids=["truncated", "audio-only"],
)
def test_a_broken_upload_fails_its_session_with_a_reason(client, data, message):
    client.create()
    assert client.upload(data).status_code == 202
    session = client.wait_for_state("error", "ingested")
    assert session["state"] == "error"
    assert message in session["error"]


NOT_A_VIDEO = (
    "not a readable video file; supported containers: mp4, mov, mkv, webm, avi, ts, flv, ogg "
    "(invalid data found when processing input)"
)


def test_an_upload_that_is_not_a_video_says_so_without_the_servers_paths_or_error_numbers(client):
    client.create()
    assert client.upload(b"these are not the frames you are looking for\n" * 100).status_code == 202
    session = client.wait_for_state("error", "ingested")
    assert (session["state"], session["error"]) == ("error", NOT_A_VIDEO)


def _events_until_ingested(client) -> list[dict]:
    """The session's events from its first, up to its `ingested` state (data only)."""
    url = f"/sessions/{client.id}/events?since=0"
    with client.http.stream("GET", url, headers=client.auth) as response:
        events = []
        for event in sse_events(response):
            events.append(event["data"])
            if event["data"] == {"type": "state", "state": "ingested", "connection": None}:
                return events
    raise AssertionError(f"no ingested state in {events}")


CUT_SHORT = (
    "the file ends after {} s of the 10.0 s it states (it was cut short, as by a download or copy that stopped "
    "part-way): {} frames were ingested, up to {} s; upload the whole file to a new session for the rest"
)
CUT_PART_WAY = (
    "the file ends part-way through a packet, after {} s (it was cut short, as by a download or copy that stopped "
    "part-way): {} frames were ingested, up to {} s; upload the whole file to a new session for the rest"
)


@pytest.mark.parametrize(
    ("container", "kept", "frames", "duration_s", "message"),
    [
        ("mp4", 50, 5, 10.0, CUT_SHORT.format(5.0, 5, 4.0)),  # faststart: its index, ahead of the frames, states 10 s
        ("webm", 55, 6, 10.0, CUT_SHORT.format(5.5, 6, 5.0)),  # cut in the middle of a cluster
        # cut at 90 % of its bytes, before its index: its header states 100 frames, FFmpeg's duration 9 s
        ("avi", 0.9, 10, 10.0, CUT_SHORT.format(9.2, 10, 9.0)),
        # cut at 90 % of its bytes, inside a packet: MPEG-TS states no length (FFmpeg reckons what it holds)
        ("ts", 0.9, 9, 9.0, CUT_PART_WAY.format(9.0, 9, 8.0)),
    ],
)
def test_a_file_cut_short_is_ingested_with_a_warning_in_the_session_and_its_events(
    client, tmp_path, container, kept, frames, duration_s, message
):
    client.create(fps=1)
    whole = faststart_mp4(10.0, tmp_path / "clip.mp4") if container == "mp4" else file_bytes(container, 10.0)
    cut = cut_before_frame(whole, kept) if isinstance(kept, int) else whole[: int(len(whole) * kept)]
    assert client.upload(cut).status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"], session["media_duration_s"]) == ("ingested", frames, duration_s)
    assert session["warnings"] == [{"code": "truncated_media", "message": message}]
    events = _events_until_ingested(client)
    warnings = [event for event in events if event["type"] == "warning"]
    assert warnings == [{"type": "warning", "code": "truncated_media", "message": message}]
    assert events[-2] == warnings[0]  # told before the session says it is ingested


def test_a_whole_file_gets_no_warning(client, tmp_path):
    client.create(fps=1)
    assert client.upload(faststart_mp4(10.0, tmp_path / "clip.mp4")).status_code == 202
    session = client.wait_for_state("ingested", "error")
    assert (session["state"], session["frames_ingested"], session["warnings"]) == ("ingested", 10, [])
    assert [event for event in _events_until_ingested(client) if event["type"] == "warning"] == []
