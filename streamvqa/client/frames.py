"""Video files and cameras as timed JPEG frames for a `frames` stream, sampled at an fps.

PyAV and Pillow come with `streamvqa[worker]`; they are imported only when a file or a camera
is read, so the client installs and runs without them otherwise.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from streamvqa.sampling import FrameSampler

Frame = tuple[float, bytes]  # (capture time in seconds, JPEG)
JPEG_QUALITY = 85
CAMERA_FORMATS = {"linux": "v4l2", "darwin": "avfoundation", "win32": "dshow"}  # FFmpeg input devices


def file_frames(path: str | Path, fps: float) -> Iterator[Frame]:
    """The first video stream of a file, sampled at `fps`; times count from its first frame.
    The file is opened now (errors are raised here), decoded as the frames are taken."""
    av = _import_av()
    container = av.open(str(path))
    if not container.streams.video:
        container.close()
        raise ValueError(f"{path} has no video stream")
    return _sampled(container, FrameSampler(fps), wall_clock=False)


def camera_frames(device: str, fps: float, input_format: str | None = None) -> Iterator[Frame]:
    """A camera through FFmpeg (`/dev/video0` with v4l2 on Linux, `0` with avfoundation on
    macOS, `video=NAME` with dshow on Windows), sampled at `fps`; times are wall-clock seconds
    from its first frame. Runs until the caller stops iterating."""
    av = _import_av()
    container = av.open(device, format=input_format or CAMERA_FORMATS.get(sys.platform), options={"framerate": "30"})
    return _sampled(container, FrameSampler(fps), wall_clock=True)


def _sampled(container: Any, sampler: FrameSampler, wall_clock: bool) -> Iterator[Frame]:
    """The container's first video stream as sampled JPEG frames; closes it when done."""
    with container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        origin_s: float | None = None  # the first frame's time: times count from it
        for frame in container.decode(stream):
            now_s = time.monotonic() if wall_clock else frame.time
            if now_s is None:
                continue
            origin_s = now_s if origin_s is None else origin_s
            time_s = now_s - origin_s
            if time_s >= 0 and sampler.keep(time_s):
                yield round(time_s, 6), _jpeg(frame)


def _jpeg(frame: Any) -> bytes:
    buffer = io.BytesIO()
    frame.to_image().save(buffer, "JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def _import_av() -> Any:
    try:
        import av
        import PIL.Image  # noqa: F401  (PyAV's to_image needs it)
    except ImportError as err:
        raise ImportError(
            f"streaming a video file or a camera needs PyAV and Pillow ({err.name} is missing): "
            "pip install 'streamvqa[worker]' (or only those two: pip install av pillow)"
        ) from err
    return av
