"""Media to frames: uploaded files (decord, PyAV as the fallback), live container byte streams
(PyAV over a blocking reader) and single images (Pillow); frames sampled by presentation time."""

import io
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np
from PIL import Image

from streamvqa.sampling import FrameSampler
from worker import containers

log = logging.getLogger(__name__)

MAX_SOURCE_PIXELS = 8192 * 8192  # larger video frames are refused before they are decoded
# Larger images (`frames` messages) are refused before they are decoded: a small PNG can declare
# a huge, uniform image, and decoding it would take 3 bytes a pixel (and more while converting).
MAX_IMAGE_PIXELS = 4096 * 4096
STREAM_BUFFER_BYTES = 4096  # PyAV's read size on live streams: small, so frames come out promptly
DECORD_BATCH_FRAMES = 8  # frames decord fetches per call
SPAN_SLACK = 2.0  # decord's frame times are trusted while they span at most this times the frames' length at its mean rate (+1 s)
# A file whose frames end more than this before the duration its container states was cut short
# (a download or copy that stopped part-way): its frames are taken, and the session warned.
TRUNCATION_MARGIN_S = 0.5
Image.MAX_IMAGE_PIXELS = None  # `decode_image` checks sizes itself (MAX_IMAGE_PIXELS, lower), with a clearer error

# The demuxers FFmpeg may use. Without a list it also reads text files (as ANSI art), images
# and dozens of rare formats; a list keeps the attack surface to the containers people send.
CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,mpeg,flv,ogg,asf,gif,ivf,h264,hevc,m4v"
STREAM_DEMUXERS = {"webm": "matroska", "mp4": "mp4"}  # live formats a client may declare
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")  # what `frames` messages may carry
INTERNAL = "(a fault of the worker; its log has the details)"  # what clients read of an unexpected error


class DecodeError(Exception):
    """The media cannot be decoded; the message is meant for the user."""


@dataclass(frozen=True)
class Frame:
    image: np.ndarray  # (H, W, 3) RGB uint8
    time_s: float  # presentation time from the start of the video


def scaled_size(width: int, height: int, max_side: int, max_pixels: int = MAX_SOURCE_PIXELS) -> tuple[int, int]:
    """(width, height) scaled down so that the longer side is at most `max_side`, keeping the
    aspect; DecodeError when the source has more than `max_pixels`."""
    if width * height > max_pixels:
        raise DecodeError(f"a {width}x{height} frame is larger than the limit of {max_pixels} pixels")
    scale = min(1.0, max_side / max(width, height))
    return max(2, round(width * scale)), max(2, round(height * scale))


# -- files ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    duration_s: float | None  # the video's as its container states it; None when it does not say
    ends_part_way: bool = False  # its container shows it was cut short (an MPEG-TS ends inside a packet)


# What a file cut short that cannot be read at all is told: an image (Pillow finds it ends before
# its pixels do), an MP4 or MOV cut before its index (`containers.mp4_index_missing`: FFmpeg cannot open it).
IMAGE_CUT_SHORT = "the file is incomplete: it ends part-way through the image, as a download or copy that stopped does"
INDEX_MISSING = (
    "the file is incomplete: it ends before its index (the `moov` box, which this MP4 or MOV file keeps at its end), as "
    "a download or copy that stopped part-way does, and no frame can be found without it; upload the whole file"
)


def probe(path: Path) -> VideoInfo:
    """What the file's first video stream is; raises DecodeError when it is not a video file (or
    an incomplete one, `INDEX_MISSING`)."""
    try:
        container = _open_container(str(path))
    except DecodeError:
        with path.open("rb") as file:
            if containers.mp4_index_missing(file, path.stat().st_size):
                raise DecodeError(INDEX_MISSING) from None
        raise
    with container:
        stream = _video_stream(container)
        if stream.duration is not None:
            duration_s = float(stream.duration * stream.time_base)
        else:  # Matroska states a track's duration in a tag, the whole file's in its header
            duration_s = _tagged_duration_s(stream.metadata.get("DURATION", ""))
            if duration_s is None and container.duration:
                duration_s = container.duration / av.time_base
        if stream.frames and stream.average_rate:  # an AVI states its length as a count of frames, which
            # FFmpeg's duration of a file cut before its index (at its end) does not follow
            duration_s = max(duration_s or 0.0, float(stream.frames / stream.average_rate))
        ends_part_way = False
        if container.format.name == "mpegts":  # it states no length: its packets tell
            with path.open("rb") as file:
                head = file.read(max(packet for packet, _ in containers.TS_PACKET_LAYOUTS) * containers.TS_PACKETS_CHECKED)
            ends_part_way = containers.ts_ends_mid_packet(head, path.stat().st_size)
        return VideoInfo(stream.codec_context.width, stream.codec_context.height, duration_s, ends_part_way)


def _tagged_duration_s(text: str) -> float | None:
    """A Matroska DURATION tag, "HH:MM:SS.nnnnnnnnn", in seconds; None when absent or malformed."""
    hours, _, rest = text.partition(":")
    minutes, _, seconds = rest.partition(":")
    try:
        duration_s = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        return None
    return duration_s if duration_s > 0 else None


def sample_file(path: Path, fps: float, max_side: int, info: VideoInfo | None = None) -> "FileFrames":
    """The first video stream of a file, sampled at `fps` and scaled to `max_side`; lazy."""
    return FileFrames(path, fps, max_side, info or probe(path))


class FileFrames:
    """A file's frames sampled by presentation time: an iterator (lazy), which also says how far
    into the video the frames decoded so far reach.

    decord reads the sampled frames directly (it seeks rather than converting every frame);
    where it fails, at the start or part-way, PyAV decodes the rest in order. PyAV checks the
    file first (`probe`), so decord only ever sees a container that FFmpeg's allowed demuxers
    recognise, at a size within the limits.
    """

    def __init__(self, path: Path, fps: float, max_side: int, info: VideoInfo) -> None:
        self.info = info
        self.end_s = 0.0  # where the frames decoded so far end: the last one's time plus its length
        self._frames = self._sample(path, fps, max_side, scaled_size(info.width, info.height, max_side))

    def __iter__(self) -> "FileFrames":
        return self

    def __next__(self) -> Frame:
        return next(self._frames)

    def close(self) -> None:
        self._frames.close()

    @property
    def cut_short(self) -> bool:
        """Once every frame is taken: the file was cut part-way: its frames end more than
        TRUNCATION_MARGIN_S before the duration the container states, or the container shows it
        ends part-way (`VideoInfo.ends_part_way`)."""
        duration_s = self.info.duration_s
        return self.info.ends_part_way or (duration_s is not None and duration_s - self.end_s > TRUNCATION_MARGIN_S)

    def _reached(self, end_s: float) -> None:
        self.end_s = max(self.end_s, end_s)

    def _sample(self, path: Path, fps: float, max_side: int, size: tuple[int, int]) -> Iterator[Frame]:
        last_s = -math.inf
        try:
            for frame in _sample_with_decord(path, fps, size, self._reached):
                last_s = frame.time_s
                yield frame
            return
        except Exception as err:  # decord raises its own errors, and some files it cannot index
            log.info("decord cannot read %s after %.3f s (%s); decoding with PyAV", path.name, last_s, err)
        for frame in _sample_with_pyav(path, fps, max_side, self._reached):
            if frame.time_s > last_s:
                yield frame


def _sample_with_decord(
    path: Path, fps: float, size: tuple[int, int], reached: Callable[[float], None] = lambda end_s: None
) -> Iterator[Frame]:
    """The sampled frames; `reached` hears where each batch read ends, in s."""
    import decord  # imported here: only the worker's file path needs it

    width, height = size
    reader = decord.VideoReader(str(path), width=width, height=height, num_threads=0)  # 0: all cores
    if len(reader) == 0:
        raise ValueError("decord found no frames")
    stamps = reader.get_frame_timestamp(range(len(reader)))  # (frames, 2): each one's start and end in s
    starts = stamps[:, 0]
    if not np.all(np.isfinite(starts)) or np.any(np.diff(starts) < 0):
        raise ValueError("timestamps out of order")  # PyAV decodes in presentation order
    rate = reader.get_avg_fps()
    if rate > 0 and starts[-1] - starts[0] > SPAN_SLACK * len(reader) / rate + 1.0:
        # Packets with no time (MPEG-4 with B-frames in an AVI) read as about -3.8e17 s
        raise ValueError(f"timestamps span {starts[-1] - starts[0]:.3g} s for {len(reader)} frames at {rate:.3g} fps")
    starts, ends = starts - starts[0], stamps[:, 1] - starts[0]
    sampler = FrameSampler(fps)
    chosen = [i for i, start in enumerate(starts) if sampler.keep(float(start))]
    for first in range(0, len(chosen), DECORD_BATCH_FRAMES):
        indices = chosen[first : first + DECORD_BATCH_FRAMES]
        batch = reader.get_batch(indices).asnumpy()  # (n, H, W, 3) uint8
        reached(float(ends[indices[-1]]))
        for index, image in zip(indices, batch, strict=True):
            yield Frame(np.ascontiguousarray(image), round(float(starts[index]), 6))
    last = len(starts) - 1
    if chosen[-1] != last:  # an index (an MP4's) may list frames past the end of a file cut short
        reader.get_batch([last])
        reached(float(ends[last]))


def _sample_with_pyav(
    path: Path, fps: float, max_side: int, reached: Callable[[float], None] = lambda end_s: None
) -> Iterator[Frame]:
    """The sampled frames, every frame decoded in order; `reached` hears where each one ends, in s."""
    with _open_container(str(path)) as container:
        stream = _video_stream(container)
        start_s = None  # the first frame's time, as decord's (an AVI's first frame may come a frame after its start)
        rate = stream.average_rate or stream.guessed_rate
        mean_length_s = float(1 / rate) if rate else 0.0
        sampler = FrameSampler(fps)
        for frame, time_s in _decoded(container, stream):
            start_s = time_s if start_s is None else start_s
            at_s = max(0.0, time_s - start_s)
            length_s = float(frame.duration * stream.time_base) if frame.duration else mean_length_s
            reached(at_s + length_s)
            if sampler.keep(at_s):
                yield Frame(_to_rgb(frame, max_side), at_s)


# -- live container streams ----------------------------------------------------------------------


def decode_stream(
    source: BinaryIO, container_format: str, max_side: int, keep: Callable[[float], bool]
) -> Iterator[Frame]:
    """The frames of a container byte stream whose time `keep` accepts, in order, as the bytes
    arrive. Times are the stream's own presentation times (not shifted to start at 0);
    `source.read` blocks for more bytes and returns b'' at the end."""
    demuxer = STREAM_DEMUXERS.get(container_format)
    if demuxer is None:
        raise DecodeError(f"unknown stream format {container_format!r}; use one of {sorted(STREAM_DEMUXERS)}")
    with _open_container(source, demuxer, buffer_size=STREAM_BUFFER_BYTES) as container:
        for frame, time_s in _decoded(container, _video_stream(container)):
            if keep(time_s):
                yield Frame(_to_rgb(frame, max_side), time_s)


# -- images --------------------------------------------------------------------------------------


def decode_image(data: bytes, max_side: int) -> np.ndarray:
    """A JPEG, PNG or WebP image as RGB uint8 (H, W, 3), scaled to `max_side`; its size is
    checked before its pixels are decoded."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = scaled_size(image.width, image.height, max_side, MAX_IMAGE_PIXELS)
        image.draft("RGB", (width, height))  # JPEG decodes at a reduced scale directly
        image = image.convert("RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        return np.asarray(image)
    except DecodeError:
        raise
    except (OSError, ValueError) as err:
        if "truncated" in str(err):  # Pillow's word for a file that ends before its pixels do
            raise DecodeError(IMAGE_CUT_SHORT) from err
        raise DecodeError("not a readable JPEG, PNG or WebP image") from err


# -- shared --------------------------------------------------------------------------------------


def _cause(err: av.FFmpegError) -> str:
    """FFmpeg's reason, readable by whoever sent the media: no error number, no file on this machine."""
    return (err.strerror or "unknown error").rstrip(".").lower()


def _open_container(source: str | BinaryIO, demuxer: str | None = None, **options: object) -> av.container.InputContainer:
    try:
        return av.open(source, format=demuxer, options={"format_whitelist": CONTAINERS}, **options)
    except av.FFmpegError as err:
        if demuxer:
            raise DecodeError(f"the stream is not {demuxer} video ({_cause(err)})") from err
        raise DecodeError(
            f"not a readable video file; supported containers: mp4, mov, mkv, webm, avi, ts, flv, ogg ({_cause(err)})"
        ) from err


def _video_stream(container: av.container.InputContainer) -> av.VideoStream:
    if not container.streams.video:
        raise DecodeError("the media has no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    return stream


def _decoded(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator[tuple[av.VideoFrame, float]]:
    """(frame, presentation time in s) in decoding order; frames without a time are skipped."""
    try:
        for frame in container.decode(stream):
            if frame.time is not None:
                yield frame, frame.time
    except av.FFmpegError as err:
        raise DecodeError(f"the video is corrupt: {_cause(err)}") from err


def _to_rgb(frame: av.VideoFrame, max_side: int) -> np.ndarray:
    width, height = scaled_size(frame.width, frame.height, max_side)
    return frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
