"""Uploaded files in every common container, and broken ones, through the real upload path."""

import pytest

from tests.app.test_stream import _audio_only_webm
from tests.media import file_bytes
from tests.support import sample_video


@pytest.mark.parametrize("container", ["mp4", "mov", "mkv", "webm", "avi"])
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
        (file_bytes("mp4", 3.0)[:2000], "not a readable video file"),  # cut before its frames' index
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
