"""Media made in the tests with PyAV and Pillow: encoded streams and files with known frame times."""

import base64
import io
import random
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
from PIL import Image

from streamvqa.protocol import frame_message

# codec -> (stream format, muxer, muxer options): each codec as a live client would send it
STREAMS = {
    "libx264": ("mp4", "mp4", {"movflags": "frag_keyframe+empty_moov+default_base_moof"}),
    "mpeg4": ("mp4", "mp4", {"movflags": "frag_keyframe+empty_moov+default_base_moof"}),
    "libvpx": ("webm", "webm", {}),
    "libvpx-vp9": ("webm", "webm", {}),
}
# container -> (muxer, codec) for uploaded files
FILES = {"mp4": ("mp4", "libx264"), "mov": ("mov", "libx264"), "mkv": ("matroska", "libvpx-vp9"),
         "webm": ("webm", "libvpx"), "avi": ("avi", "mpeg4"), "ts": ("mpegts", "libx264")}


def picture(index: int, width: int = 160, height: int = 120) -> np.ndarray:
    """A frame that changes with its index: a moving bar on a coloured ground, RGB uint8."""
    image = np.zeros((height, width, 3), np.uint8)
    image[:] = ((index * 37) % 256, (index * 91) % 256, 128)
    x = (index * 7) % (width - 16)
    image[:, x : x + 16] = 255
    return image


def encode(codec: str, muxer: str, seconds: float, rate: int = 10, options: dict | None = None,
           size: tuple[int, int] = (160, 120), gop: int | None = None, path: Path | None = None) -> bytes:
    """`seconds` of video at `rate` frames per second; frame i is at i / rate seconds. Written to
    `path` when given (a muxer that rewrites the file at its end, as MP4's `faststart`, needs one)."""
    buffer = io.BytesIO()
    with av.open(str(path) if path else buffer, "w", format=muxer, options=options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.gop_size = gop or rate  # a keyframe (and a fragment) every second
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "bf": "0"}
        elif codec.startswith("libvpx"):
            stream.options = {"deadline": "realtime", "cpu-used": "8", "lag-in-frames": "0"}
        for i in range(round(seconds * rate)):
            frame = av.VideoFrame.from_ndarray(picture(i, *size), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path.read_bytes() if path else buffer.getvalue()


def stream_bytes(codec: str, seconds: float, rate: int = 10) -> tuple[str, bytes]:
    """(format, bytes) of a live stream in `codec`."""
    stream_format, muxer, options = STREAMS[codec]
    return stream_format, encode(codec, muxer, seconds, rate, options)


def file_bytes(container: str, seconds: float, rate: int = 10) -> bytes:
    muxer, codec = FILES[container]
    return encode(codec, muxer, seconds, rate)


def faststart_mp4(seconds: float, path: Path) -> bytes:
    """H.264 in an MP4 whose index (`moov`) comes before its frames, as made for the web: cut
    part-way, it still opens, and still states the whole duration. Written to `path`."""
    return encode("libx264", "mp4", seconds, options={"movflags": "faststart"}, path=path)


def cut_before_frame(data: bytes, index: int) -> bytes:
    """A video file's first bytes, up to where its frame `index` (in file order) begins: a file
    cut short, as by a download that stopped, holding exactly frames 0 to index - 1."""
    with av.open(io.BytesIO(data)) as container:
        packets = (p for p in container.demux(video=0) if p.size)
        position = next(p.pos for i, p in enumerate(packets) if i == index)
    return data[:position]


def random_cuts(data: bytes, seed: int, pieces: int = 12) -> Iterator[bytes]:
    """`data` cut at `pieces - 1` random byte boundaries."""
    cuts = sorted(random.Random(seed).sample(range(1, len(data)), pieces - 1))
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        yield data[start:end]


def jpeg(index: int, size: tuple[int, int] = (160, 120)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(picture(index, *size)).save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


def png(index: int, size: tuple[int, int] = (160, 120)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(picture(index, *size)).save(buffer, "PNG")
    return buffer.getvalue()


def timed_jpeg(time_s: float, index: int = 0) -> bytes:
    return frame_message(time_s, jpeg(index))


def data_url(data: bytes, media_type: str) -> str:
    """`data` as a data URL, as a chat client sends media in its messages."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
