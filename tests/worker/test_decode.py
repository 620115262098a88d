"""Video files become frames sampled by presentation time; a file cut short is told from a whole one."""

import io

import av
import numpy as np
import pytest

from tests.media import file_bytes, jpeg, png
from tests.support import sample_video
from streamvqa.sampling import FrameSampler
from worker import containers
from worker.decode import DecodeError, decode_image, sample_file


@pytest.mark.parametrize(
    ("name", "fps", "expected_times_s"),
    [
        ("bikes.mp4", 1.0, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]),  # 10 s at 25 fps
        ("bikes.mp4", 0.5, [0.0, 2.0, 4.0, 6.0, 8.0]),
        ("bigbuckbunny.mp4", 2.0, [0.0, 0.52, 1.0, 1.52, 2.0, 2.52, 3.0, 3.52, 4.0, 4.52, 5.0]),  # 25 fps
        ("carphone_pristine.mp4", 2.0, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]),
    ],
)
def test_sample_videos_give_frames_at_the_expected_times(name, fps, expected_times_s):
    times = [round(frame.time_s, 2) for frame in sample_file(sample_video(name), fps, max_side=768)]
    assert times == expected_times_s


def test_frames_are_rgb_and_scaled_down_to_the_longest_side():
    first = next(sample_file(sample_video("bikes.mp4"), 1.0, max_side=320))  # 640x272 source
    assert first.image.shape == (136, 320, 3)
    assert first.image.dtype.name == "uint8"
    small = next(sample_file(sample_video("carphone_pristine.mp4"), 1.0, max_side=768))  # 176x144
    assert small.image.shape == (144, 176, 3)


def test_a_file_that_is_not_a_video_is_a_decode_error(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("these are not the frames you are looking for\n" * 100)
    with pytest.raises(DecodeError) as raised:
        list(sample_file(path, 1.0, max_side=768))
    assert str(raised.value) == (  # what the client reads: no path of this machine, no error number
        "not a readable video file; supported containers: mp4, mov, mkv, webm, avi, ts, flv, ogg (invalid argument)"
    )


def test_sampler_keeps_the_first_frame_at_or_after_each_grid_point():
    sampler = FrameSampler(fps=1.0)
    times = [k / 30 for k in range(95)]  # 30 fps for a little over 3 s
    assert [round(t, 3) for t in times if sampler.keep(t)] == [0.0, 1.0, 2.0, 3.0]


def test_sampler_skips_the_grid_points_inside_a_gap():
    sampler = FrameSampler(fps=2.0)
    assert [t for t in [0.0, 0.2, 0.5, 3.2, 3.3, 3.5, 3.9, 4.0] if sampler.keep(t)] == [0.0, 0.5, 3.2, 3.5, 4.0]


def _write_video(path, codec: str, seconds: int = 3, rate: int = 10) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for index in range(seconds * rate):
            image = np.full((64, 96, 3), index * 8 % 256, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())


@pytest.mark.parametrize(
    ("suffix", "codec"), [(".avi", "mpeg4"), (".mkv", "mpeg4"), (".webm", "libvpx"), (".mov", "libx264")]
)
def test_common_containers_decode(tmp_path, suffix, codec):
    path = tmp_path / f"clip{suffix}"
    _write_video(path, codec)
    assert [round(f.time_s, 2) for f in sample_file(path, 1.0, max_side=768)] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("container", ["mp4", "mov", "mkv", "webm", "avi"])
def test_decord_reads_the_sampled_frames_of_each_container(tmp_path, container):
    from tests.media import file_bytes
    from worker.decode import _sample_with_decord

    path = tmp_path / f"clip.{container}"
    path.write_bytes(file_bytes(container, 3.0))  # 3 s at 10 frames per second, 160x120
    frames = list(_sample_with_decord(path, 2.0, (80, 60)))
    assert [f.time_s for f in frames] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert frames[0].image.shape == (60, 80, 3)


def _video(tmp_path, container: str) -> bytes:
    """10 s at 10 frames per second; an MP4 with its index (`moov`) ahead of its frames."""
    from tests.media import faststart_mp4, file_bytes

    return faststart_mp4(10.0, tmp_path / "whole.mp4") if container == "mp4" else file_bytes(container, 10.0)


@pytest.mark.parametrize(
    ("container", "frames_kept", "fps", "expected_times_s", "end_s"),
    [
        ("mp4", 50, 1.0, [0.0, 1.0, 2.0, 3.0, 4.0], 5.0),  # the index lists all 10 s; half the frames are there
        ("mp4", 85, 0.25, [0.0, 4.0, 8.0], 8.5),  # cut after the last sampled frame: the index's last frame is missing
        ("webm", 55, 1.0, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 5.5),  # cut in the middle of the cluster of 5 to 6 s
        ("mkv", 55, 1.0, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 5.5),
    ],
)
def test_a_file_cut_short_gives_the_frames_it_has_and_says_where_they_end(
    tmp_path, container, frames_kept, fps, expected_times_s, end_s
):
    from tests.media import cut_before_frame

    path = tmp_path / f"cut.{container}"
    path.write_bytes(cut_before_frame(_video(tmp_path, container), frames_kept))
    frames = sample_file(path, fps, max_side=768)
    assert [round(f.time_s, 2) for f in frames] == expected_times_s
    assert (round(frames.end_s, 3), frames.info.duration_s, frames.cut_short) == (end_s, 10.0, True)


@pytest.mark.parametrize("container", ["mp4", "webm", "mkv", "mov", "avi", "ts"])
@pytest.mark.parametrize(("fps", "count"), [(0.25, 3), (1.0, 10), (4.0, 40)])
def test_a_whole_file_is_not_cut_short(tmp_path, container, fps, count):
    path = tmp_path / f"whole.{container}"
    path.write_bytes(_video(tmp_path, container))
    frames = sample_file(path, fps, max_side=768)
    assert len(list(frames)) == count
    assert (round(frames.end_s, 3), frames.info.duration_s, frames.cut_short) == (10.0, 10.0, False)


@pytest.mark.parametrize(("name", "end_s"), [("bikes.mp4", 10.0), ("bigbuckbunny.mp4", 5.28), ("carphone_pristine.mp4", 4.004)])
def test_the_sample_videos_are_not_cut_short(name, end_s):
    frames = sample_file(sample_video(name), 1.0, max_side=320)
    list(frames)
    assert (round(frames.end_s, 3), frames.cut_short) == (end_s, False)


def _avi_with_b_frames(path, seconds: float, rate: int = 10):
    """MPEG-4 Part 2 with B-frames in an AVI (as OpenCV's Megamind.avi sample): the first
    packets carry no time, and decord reads about -3.8e17 s for their frames."""
    from tests.media import picture

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        stream.codec_context.max_b_frames = 2
        for i in range(round(seconds * rate)):
            frame = av.VideoFrame.from_ndarray(picture(i), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def test_an_avi_whose_first_frames_have_no_time_gives_its_own_times(tmp_path):
    """Not a video time of about 4e17 s: frame times an index cannot give are read by decoding."""
    frames = sample_file(_avi_with_b_frames(tmp_path / "b-frames.avi", 5.0), 1.0, max_side=768)
    assert [round(f.time_s, 2) for f in frames] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert (round(frames.end_s, 3), frames.cut_short) == (5.0, False)


def test_an_avi_cut_before_its_index_is_cut_short_of_the_frame_count_its_header_states(tmp_path):
    """FFmpeg's duration of an AVI without its index (at its end) follows the file's size; the
    header's 100 frames at 10 fps say 10 s."""
    path = tmp_path / "cut.avi"
    whole = file_bytes("avi", 10.0)
    path.write_bytes(whole[: len(whole) * 9 // 10])
    frames = sample_file(path, 1.0, max_side=768)
    assert [round(f.time_s, 2) for f in frames] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert (round(frames.end_s, 3), frames.info.duration_s, frames.cut_short) == (9.2, 10.0, True)


def test_an_mpeg_ts_cut_inside_a_packet_is_cut_short(tmp_path):
    """MPEG-TS states no length: a file that ends inside one of its 188-byte packets was cut (one
    cut at a packet's end looks like a whole stream)."""
    whole = file_bytes("ts", 10.0)
    path = tmp_path / "cut.ts"
    path.write_bytes(whole[: len(whole) * 9 // 10])
    frames = sample_file(path, 1.0, max_side=768)
    assert [round(f.time_s, 2) for f in frames] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert (frames.info.ends_part_way, frames.cut_short) == (True, True)
    path.write_bytes(whole)
    frames = sample_file(path, 1.0, max_side=768)
    assert (len(list(frames)), frames.info.ends_part_way, frames.cut_short) == (10, False, False)


@pytest.mark.parametrize("container", ["mp4", "mov"])
@pytest.mark.parametrize("kept", [0.9, 0.5, 0.01])
def test_an_mp4_cut_before_its_index_at_its_end_is_said_to_be_incomplete(tmp_path, container, kept):
    whole = file_bytes(container, 10.0)  # its index (`moov`) after its frames
    path = tmp_path / f"cut.{container}"
    path.write_bytes(whole[: int(len(whole) * kept)])
    with pytest.raises(DecodeError) as raised:
        sample_file(path, 1.0, max_side=768)
    assert str(raised.value) == (
        "the file is incomplete: it ends before its index (the `moov` box, which this MP4 or MOV file keeps at its end), "
        "as a download or copy that stopped part-way does, and no frame can be found without it; upload the whole file"
    )


def test_ts_packets_and_mp4_boxes_tell_a_file_cut_short():
    packet = bytes([containers.TS_SYNC]) + bytes(187)
    assert not containers.ts_ends_mid_packet(packet * 8, 188 * 100)
    assert containers.ts_ends_mid_packet(packet * 8, 188 * 100 + 55)
    m2ts = (bytes(4) + packet) * 8  # a 4-byte time before each packet
    assert (containers.ts_ends_mid_packet(m2ts, 192 * 50), containers.ts_ends_mid_packet(m2ts, 192 * 50 - 1)) == (False, True)
    assert not containers.ts_ends_mid_packet(b"not a stream" * 200, 12345)  # says nothing of what it does not know

    def boxes(*pairs: tuple[bytes, int]) -> io.BytesIO:
        return io.BytesIO(b"".join((8 + length).to_bytes(4, "big") + kind + bytes(length) for kind, length in pairs))

    whole = boxes((b"ftyp", 16), (b"mdat", 1000), (b"moov", 300))
    size = len(whole.getvalue())
    assert not containers.mp4_index_missing(whole, size)
    assert containers.mp4_index_missing(whole, size - 300)  # cut inside the index
    assert containers.mp4_index_missing(whole, 600)  # cut inside the frames, before the index
    assert not containers.mp4_index_missing(boxes((b"ftyp", 16), (b"moov", 300), (b"mdat", 1000)), 600)  # index first
    assert not containers.mp4_index_missing(io.BytesIO(b"RIFF" + bytes(100)), 104)  # not an MP4


def test_an_image_cut_short_is_said_to_be_incomplete():
    for whole in (jpeg(7, (640, 480)), png(7, (640, 480))):
        cut = whole[: len(whole) // 2]
        with pytest.raises(DecodeError) as raised:
            decode_image(cut, max_side=768)
        assert str(raised.value) == (
            "the file is incomplete: it ends part-way through the image, as a download or copy that stopped does"
        )
    with pytest.raises(DecodeError) as raised:
        decode_image(b"\xff\xd8\xff" + bytes(100), max_side=768)
    assert str(raised.value) == "not a readable JPEG, PNG or WebP image"
