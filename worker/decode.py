"""Video files to frames sampled by presentation time (PyAV)."""

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

TIME_TOLERANCE_S = 1e-3  # frame times within this of a sampling point count as on it

# The demuxers FFmpeg may use. Without a list it also reads text files (as ANSI art), images
# and dozens of rare formats; a list keeps the attack surface to the containers people send.
CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,mpeg,flv,ogg,asf,gif,ivf,h264,hevc,m4v"


class DecodeError(Exception):
    """The media cannot be decoded; the message is meant for the user."""


@dataclass(frozen=True)
class Frame:
    image: np.ndarray  # (H, W, 3) RGB uint8
    time_s: float  # presentation time from the start of the video


class FrameSampler:
    """Keeps the first frame at or after each point of the grid 0, 1/fps, 2/fps, ...

    Frames that arrive when the next grid point is still ahead are skipped; a gap in the video
    skips the grid points inside it, so no frame is ever repeated.
    """

    def __init__(self, fps: float) -> None:
        if not fps > 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.fps = fps
        self._next_s = 0.0

    def keep(self, time_s: float) -> bool:
        if time_s + TIME_TOLERANCE_S < self._next_s:
            return False
        self._next_s = (math.floor((time_s + TIME_TOLERANCE_S) * self.fps) + 1) / self.fps
        return True


def sample_file(path: Path, fps: float, max_side: int) -> Iterator[Frame]:
    """Decode the first video stream of a file, yielding frames sampled at `fps`.

    Frames larger than `max_side` on their longer side are scaled down, keeping their aspect.
    """
    try:
        container = av.open(str(path), options={"format_whitelist": CONTAINERS})
    except av.FFmpegError as err:
        raise DecodeError(
            f"not a readable video file; supported containers: mp4, mov, mkv, webm, avi, ts, flv, ogg ({err})"
        ) from err
    with container:
        if not container.streams.video:
            raise DecodeError("the file has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        start_s = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        sampler = FrameSampler(fps)
        try:
            for frame in container.decode(stream):
                if frame.time is None:
                    continue
                time_s = max(0.0, frame.time - start_s)
                if sampler.keep(time_s):
                    yield Frame(_to_rgb(frame, max_side), time_s)
        except av.FFmpegError as err:
            raise DecodeError(f"the video is corrupt: {err}") from err


def _to_rgb(frame: av.VideoFrame, max_side: int) -> np.ndarray:
    scale = min(1.0, max_side / max(frame.width, frame.height))
    width, height = max(2, round(frame.width * scale)), max(2, round(frame.height * scale))
    return frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
