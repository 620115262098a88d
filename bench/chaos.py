"""Faults injected into a running deployment, and what they cost: questions, frames, stuck sessions, recovery.

    python -m bench.chaos [--seconds 300] [--grace-s 300] [--streamers 3] [--uploaders 2] [--chatters 1]
                          [--fault-every 30] [--faults worker,gateway,redis] [--fsync always] [--lease-ttl-s 5] [--seed 1]

Starts Redis with an append-only file (`appendfsync always`; `--fsync everysec` shows what the
last second of writes costs), two gateways and two workers serving `tiny-random-llava`, all on
loopback. Clients use either gateway and move to the other when theirs is down:

- streamers: a `frames` socket each, frames in real time at 2 fps (sessions at 2 fps) for the
  whole run (so each live stream's video passes 64 s, 128 s, ... beside the uploads on the same
  workers, in steps that batch them), and a question every few seconds (`POST /ask`, then its
  answer by id). On any close the socket connects again (either gateway) with `resume` and
  sends on after the `last_frame_s` it is told, unless its session failed (state `error`, or
  gone): then the stream counts as failed and stops;
- uploaders: create a session, upload a generated 6-s video, wait until it is ingested, ask two
  questions, delete it; again and again;
- watches: each streamer's session has one at the default threshold, and adds one at
  LEAST_THRESHOLD (which fires at its first check, whatever p(yes) is: a firing that must come)
  every NEW_WATCH_EVERY_S, deleting its oldest once it fired (at most LEAST_KEPT); each upload's
  session has one at LEAST_THRESHOLD, made before the upload. Each session's firings are
  followed over its Server-Sent Events (through either gateway, resuming after the last event
  id on any break), and each watch's state is read at the end (at its deletion for those
  deleted), once its first check is done where one must be;
- one idle session, shown one frame, then asked now and then (it leaves its worker in between:
  IDLE_RELEASE_S=20);
- a chat user (`--chatters`): every few seconds a `/v1/chat/completions` about an image, one of
  CHAT_IMAGES (its conversation's session, found again by the image), or at random (one time in
  three) an image the worker refuses (8000x4000 pixels): a 400 `invalid_media` is the right
  answer to it, anything else (a 504 after ASK_TIMEOUT_S, a 404, no answer) is wrong.

Every `--fault-every` seconds (0.5x to 1.5x, at random), once the last fault has been recovered
from, one of `--faults`: kill -9 a worker, a gateway or Redis, restarted 1 to 3 s later (Redis
from its append-only file). Recovery is the time from the kill until every live session (the
streamers' and the idle one) answers a question again. After `--seconds` the streams end, every
answer still out is awaited, and one JSON line sums it up, always, at the latest `--grace-s`
after `--seconds` (every client loop and every wait is bounded; a client still busy then is cut
and counted in `clients_cut`):

- `faults`: injected, by kind; `recovery_max_s` (target: within LEASE_TTL_S + 10 s) and each one;
- questions `asked` (an answer id came back), `answered` (done), `reset` (ended `session_reset`:
  the worker died while answering; the client asks again), `lost` (no final event),
  `answered_twice` (two final events, or more tokens than the answer has);
- frames `sent`, `ingested`, `duplicated`, `lost` (streams), and uploads whose frame count is off;
- `stuck`: sessions left `pending` or `ingesting`, or that did not answer a last question;
- watches: `watches` made, `firings` (`watch_fired` events over SSE), `firings_due` (watches at
  LEAST_THRESHOLD whose first check's time the video passed), `firings_lost` (such a watch with
  no firing in its state, or a firing in a watch's state never sent), `firings_twice` (a
  `watch_fired` sent again for the same watch and time, or a LEAST_THRESHOLD watch that fired at
  two times), `firings_unrecorded` (sent, and not in the watch's state), `watches_unjudged`
  (whose state could not be read);
- chat completions: `chat_answered` (200), `chat_failed` (another reply to an image the worker
  reads), `chat_refused_right` and `chat_refused_wrong` (the refused image's replies, the worst
  one's seconds in `chat_refused_max_s`); their answers count among `asked` above;
- `failed_sessions`: sessions that turned `error` (streams, uploads, the idle one), named in
  `failed`; `streams_video_s`: how far each live stream's video got; `mean_batch`: sessions per
  engine step of the workers alive at the end.

Every counter is printed, 0 or not (besides those by status or code, `ask_refused_<status>`,
`watch_refused_<status>` and `error_<code>`, printed when they happen). Targets: 0 lost, 0 twice,
0 stuck, 0 failed, 0 wrong chat refusals, 0 firings lost, twice or unrecorded
(docs/benchmarks.md has the figures).

One module, over 400 lines: a benchmark's whole fault schedule, its clients and its report read best in one place.
"""

import argparse
import asyncio
import base64
import io
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import av
import httpx
import numpy as np
import redis.asyncio as aioredis
import websockets
from PIL import Image
from redis.exceptions import RedisError

from streamvqa import children
from streamvqa.client.sse import SseDecoder
from streamvqa.protocol import AnswerEnvelope, EventEnvelope, frame_message
from streamvqa.protocol.watches import DEFAULT_THRESHOLD
from streamvqa.redis_server import EmbeddedRedis, free_port
from streamvqa.run import wait_until_serving

FPS = 2.0  # frames a second, sent and sampled
UPLOAD_SECONDS, UPLOAD_FPS = 6, 1.0  # each upload: 6 s of video sampled at 1 fps, 6 frames
ASK_EVERY_S = 4.0
CALL_TIMEOUT_S = 90.0  # how long a client keeps retrying one call through faults
DRAIN_S = 120.0  # how long answers still out are awaited at the end
RESENT_FRAMES = 600  # frames a streamer keeps to send again after a reconnection
RECOVERY_LIMIT_S = 120.0  # a fault not recovered from by then counts as not recovered (null)
RECONNECT_S = 30.0  # how long a streamer keeps connecting again after the run's end, or without a reply
FINAL_S = 100.0  # of the grace, what the last questions and the end states may take
CHAT_EVERY_S = 3.0  # between a chat user's completions
CHAT_IMAGES = 4  # the images a chat user asks about in turn (one session each, found again by its image)
CHAT_REFUSED_SHARE = 1 / 3  # of its completions, those about an image the worker refuses
CHAT_MODEL = "tiny-random-llava"
COUNTERS = (  # tally.counts printed always, 0 or not
    "uploads", "uploads_refused", "uploads_not_created", "clients_cut", "client_errors", "streams_not_ended",
    "end_not_checked", "chat_answered", "chat_failed", "chat_refused_right", "chat_refused_wrong",
)
VERDICTS = ("answered", "reset", "lost", "answered_twice")  # of each asked answer (besides error_<code>)
FRAME_COUNTS = ("sent", "ingested", "duplicated", "lost", "dropped")
WATCH_CONDITION = "a red circle is visible"
WATCH_EVERY_S = 2.0
LEAST_THRESHOLD = 1e-6  # fires at a watch's first check, whatever p(yes) is (a threshold must be > 0)
NEW_WATCH_EVERY_S = 10.0  # how often a streamer adds a watch at LEAST_THRESHOLD
LEAST_KEPT = 4  # a streamer's watches at LEAST_THRESHOLD at once (MAX_WATCHES_PER_SESSION is 8)
WATCH_SETTLE_S = 30.0  # how long a watch whose first check is due may take to run it, at the end
SSE_READ_S = 40.0  # without a byte on a session's events (keepalives come every 15 s): connect again


def _jpeg(index: int) -> bytes:
    image = np.zeros((48, 64, 3), np.uint8)
    image[:] = ((index * 37) % 256, (index * 91) % 256, 128)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=70)
    return buffer.getvalue()


def _huge_png() -> bytes:
    """An image over the worker's pixel limit (8000x4000 of one colour: a few KB): it refuses it."""
    buffer = io.BytesIO()
    Image.new("RGB", (8000, 4000), (40, 90, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def _data_url(image: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(image).decode()}"


def _video() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        for i in range(UPLOAD_SECONDS * 10):
            image = np.full((120, 160, 3), (i * 7) % 256, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


class Deployment:
    """Redis, two gateways and two workers as child processes, each killed and started again at will."""

    def __init__(self, folder: Path, args: argparse.Namespace) -> None:
        self.redis = EmbeddedRedis(folder / "redis", appendfsync=args.fsync)
        self.prefix = f"svqa-chaos-{uuid.uuid4().hex[:8]}:"
        self.ports = [free_port(), free_port()]
        self.env = {
            **os.environ, "REDIS_PREFIX": self.prefix, "MODEL": "tiny-random-llava", "LOG_LEVEL": "WARNING",
            "SPOOL_DIR": str(folder / "spool"), "SNAPSHOT_DIR": str(folder / "snapshots"), "MAX_SESSIONS": "16",
            "LEASE_TTL_S": str(args.lease_ttl_s), "SNAPSHOT_INTERVAL_S": "2", "IDLE_RELEASE_S": "20",
            "LIVE_MAX_LAG_S": "1000", "RATE_LIMIT_PER_S": "0", "MAX_SESSIONS_PER_KEY": "1000", "TORCH_THREADS": "1",
        }
        self.logs = folder
        self.processes: dict[str, Popen] = {}

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def start(self) -> None:
        self.env["REDIS_URL"] = self.redis.start()
        for name in ("worker0", "worker1", "gateway0", "gateway1"):
            self.spawn(name)
        wait_until_serving(f"{self.urls[0]}/healthz", self.env["REDIS_URL"], self.prefix, list(self.processes.values()), 300, 2)

    def spawn(self, name: str) -> None:
        env = {**self.env, **({"PORT": str(self.ports[int(name[-1])])} if name.startswith("gateway") else {})}
        with (self.logs / f"{name}.log").open("ab") as log:
            module = "app" if name.startswith("gateway") else "worker"
            self.processes[name] = children.spawn([sys.executable, "-m", module], env, stdout=log, stderr=log)

    def kill(self, name: str) -> None:
        if name == "redis":
            self.redis.kill()
        else:
            self.processes[name].kill()
            self.processes[name].wait()

    def restart(self, name: str) -> None:
        if name == "redis":
            self.redis.start()
        else:
            self.spawn(name)

    def stop(self) -> None:
        for process in self.processes.values():
            children.stop(process)
        self.redis.stop()


@dataclass
class Watched:
    """A watch a client made, and its state when it was judged."""

    threshold: float
    due_s: float  # the video time of its first check
    fired_s: list[float] | None = None  # the firings its state holds, once judged (None: not judged)
    must_fire: bool = False  # at LEAST_THRESHOLD, and the session's video passed `due_s`


class Tally:
    def __init__(self) -> None:
        self.asked: dict[str, str] = {}  # answer id -> session id
        self.counts: Counter = Counter()
        self.streams: dict[str, str] = {}  # the streamers' sessions: id -> token
        self.sent: dict[str, set[float]] = {}  # session -> frame times sent
        self.uploads_off: list[tuple[str, int]] = []  # (session, frames) for uploads with the wrong frame count
        self.recoveries: list[tuple[str, float]] = []
        self.judged: dict[str, str] = {}  # answer id -> answered, reset, lost, answered_twice, error_<code>
        self.lost_frames: list[float] = []
        self.failed: dict[str, str] = {}  # sessions that turned `error` (or vanished): id -> what said so
        self.frames: Counter = Counter()
        self.video_s: dict[str, float] = {}  # each live stream's video time at the end
        self.mean_batch: float | None = None
        self.chats: set[str] = set()  # the sessions chat completions answered from
        self.chat_refused_s: list[float] = []  # how long each refused image's reply took
        self.chat_wrong: list[str] = []  # what a refused image got instead of its 400, or an image's failure
        self.watches: dict[tuple[str, str], Watched] = {}  # (session, watch id) -> the watch
        self.fired: defaultdict[tuple[str, str], list[float]] = defaultdict(list)  # (session, watch id) -> each firing over SSE
        self.followers: list[asyncio.Task] = []  # the streamers' sessions' events, followed until the end


class Api:
    """REST calls through either gateway, retried through faults (the other gateway, 503s)."""

    def __init__(self, http: httpx.AsyncClient, urls: list[str], rng: random.Random) -> None:
        self.http, self.urls = http, urls
        self.at = rng.randrange(len(urls))

    async def call(self, method: str, path: str, token: str | None = None, retry: tuple[int, ...] = (503,), **kwargs) -> httpx.Response:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        while True:
            try:
                reply = await self.http.request(method, self.urls[self.at] + path, headers=headers, **kwargs)
                if reply.status_code not in retry or time.monotonic() > deadline:
                    return reply
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                self.at = (self.at + 1) % len(self.urls)
            await asyncio.sleep(0.3)

    async def ask(self, session: tuple[str, str], tally: Tally, question: str) -> str | None:
        """Ask and follow the answer to its end: done, reset (asked again by the caller), or
        None when the question was never taken (its call failed: not counted as asked)."""
        sid, token = session
        try:
            reply = await self.call("POST", f"/sessions/{sid}/ask", token, json={"question": question, "max_new_tokens": 4, "wait_s": 0})
        except httpx.TransportError:
            return None
        if reply.status_code != 202:
            tally.counts[f"ask_refused_{reply.status_code}"] += 1
            return None
        answer_id = reply.json()["answer_id"]
        tally.asked[answer_id] = sid
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                found = await self.call("GET", f"/sessions/{sid}/answers/{answer_id}", token)
            except httpx.TransportError:
                continue
            status = found.json().get("status") if found.status_code == 200 else None
            if status == "done":
                return "done"
            if status == "error":
                return found.json()["code"]
            await asyncio.sleep(0.3)
        return "timeout"

    async def create(self, **options: object) -> tuple[str, str]:
        reply = await self.call("POST", "/sessions", json=options)
        reply.raise_for_status()
        return reply.json()["id"], reply.json()["token"]


async def _asking(api: Api, session: tuple[str, str], tally: Tally, stop: asyncio.Event, every_s: float) -> None:
    while not stop.is_set() and session[0] not in tally.failed:
        result = await api.ask(session, tally, "What do you see?")
        if result == "session_reset":
            continue  # asked again at once
        if result == "session_error" and await _failed(api, session, tally):
            return
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def _streamer(api: Api, tally: Tally, stop: asyncio.Event, rng: random.Random) -> None:
    session = await api.create(fps=FPS)
    sid, token = session
    tally.streams[sid] = token
    tally.sent[sid] = set()
    tally.followers.append(asyncio.create_task(_follow(api, session, tally)))
    asker = asyncio.create_task(_asking(api, session, tally, stop, ASK_EVERY_S))
    watcher = asyncio.create_task(_watching(api, session, tally, stop))
    recent: deque[tuple[float, bytes]] = deque(maxlen=RESENT_FRAMES)
    connection, index, started = None, 0, time.monotonic()
    ended, connected_at = False, time.monotonic()
    while not ended:
        if stop.is_set() and time.monotonic() - max(connected_at, started) > RECONNECT_S:
            tally.counts["streams_not_ended"] += 1  # never connected again to say `end`
            break
        if time.monotonic() - connected_at > RECONNECT_S and await _failed(api, session, tally):
            break
        url = api.urls[api.at].replace("http://", "ws://") + f"/sessions/{sid}/stream?token={token}"
        try:
            async with websockets.connect(url, max_size=None, open_timeout=10) as socket:
                await socket.send(json.dumps({"type": "start", "format": "frames", **({"resume": connection} if connection else {})}))
                hello = json.loads(await asyncio.wait_for(socket.recv(), 30))
                if hello.get("type") != "started":
                    raise OSError(f"not started: {hello}")
                connection, last_s = hello["connection"], hello["last_frame_s"]
                connected_at = time.monotonic()
                for time_s, message in list(recent):  # what the gateway never received
                    if last_s is None or time_s > last_s:
                        await socket.send(message)
                drain = asyncio.create_task(_drain(socket))
                drain.add_done_callback(lambda task: task.cancelled() or task.exception())
                while not stop.is_set():
                    due = started + index / FPS
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    time_s = index / FPS
                    message = frame_message(time_s, _jpeg(index))
                    recent.append((time_s, message))
                    tally.sent[sid].add(time_s)
                    index += 1
                    await socket.send(message)
                    if drain.done():
                        drain.result()
                await socket.send(json.dumps({"type": "end"}))
                ended = True
                drain.cancel()
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as err:
            closed = getattr(err, "rcvd", None)
            if closed is not None and closed.code in (4401, 4404, 4409) and await _failed(api, session, tally):
                break  # the session failed, or is gone: no socket will take its frames again
            api.at = (api.at + 1) % len(api.urls) if rng.random() < 0.5 else api.at
            await asyncio.sleep(0.5)
    await asker
    await watcher


async def _add_watch(api: Api, session: tuple[str, str], tally: Tally, threshold: float) -> str | None:
    """A watch on the session, its id (None when the call failed or was refused)."""
    sid, token = session
    body = {"condition": WATCH_CONDITION, "every_s": WATCH_EVERY_S, "threshold": threshold}
    try:
        reply = await api.call("POST", f"/sessions/{sid}/watches", token, json=body)
    except httpx.TransportError:
        return None
    if reply.status_code != 201:
        tally.counts[f"watch_refused_{reply.status_code}"] += 1
        return None
    watch = reply.json()
    tally.watches[sid, watch["id"]] = Watched(threshold, watch["created_video_s"] + WATCH_EVERY_S)
    return watch["id"]


async def _watching(api: Api, session: tuple[str, str], tally: Tally, stop: asyncio.Event) -> None:
    """A streamer's watches: one at the default threshold, and one at LEAST_THRESHOLD every
    NEW_WATCH_EVERY_S, the oldest judged and deleted once it fired when LEAST_KEPT are there."""
    await _add_watch(api, session, tally, DEFAULT_THRESHOLD)
    least: deque[str] = deque()
    while not stop.is_set() and session[0] not in tally.failed:
        if len(least) >= LEAST_KEPT and await _judge_watch(api, session, least[0], tally, settle_s=0, delete=True):
            least.popleft()
        if len(least) < LEAST_KEPT and (watch_id := await _add_watch(api, session, tally, LEAST_THRESHOLD)):
            least.append(watch_id)
        try:
            await asyncio.wait_for(stop.wait(), NEW_WATCH_EVERY_S)
        except TimeoutError:
            pass


async def _judge_watch(api: Api, session: tuple[str, str], watch_id: str, tally: Tally, settle_s: float = WATCH_SETTLE_S,
                       delete: bool = False) -> bool:
    """Read the watch's state (after at most `settle_s` for its first check, where its session's
    video passed it and it must fire) and keep its firings; with `delete`, only a watch that
    fired is judged, then deleted. Whether it was judged."""
    sid, token = session
    watched = tally.watches[sid, watch_id]
    deadline = time.monotonic() + settle_s
    try:
        while True:
            found = await api.call("GET", f"/sessions/{sid}", token)
            video_s = found.json().get("video_time_s") if found.status_code == 200 else None
            reply = await api.call("GET", f"/sessions/{sid}/watches/{watch_id}", token)
            if reply.status_code == 404 and delete and watched.fired_s is not None:
                return True  # judged, and deleted by a call whose reply was lost
            if reply.status_code != 200 or video_s is None:
                return False
            state = reply.json()
            must_fire = watched.threshold == LEAST_THRESHOLD and video_s >= watched.due_s - 1e-6
            if state["checks"] or not must_fire or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        if delete and not state["fired"]:
            return False
        watched.fired_s, watched.must_fire = [f["time_s"] for f in state["fired"]], must_fire
        if delete:
            await api.call("DELETE", f"/sessions/{sid}/watches/{watch_id}", token)
        return True
    except httpx.TransportError:
        return False


async def _judge_watches(api: Api, session: tuple[str, str], tally: Tally) -> None:
    """Every watch of the session not judged yet; then at most a few seconds for the firings
    their states hold to arrive over SSE."""
    sid = session[0]
    mine = [watch_id for (s, watch_id), watched in tally.watches.items() if s == sid and watched.fired_s is None]
    await asyncio.gather(*(_judge_watch(api, session, watch_id, tally) for watch_id in mine))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        set(w.fired_s or ()) - set(tally.fired[key]) for key, w in tally.watches.items() if key[0] == sid
    ):
        await asyncio.sleep(0.2)


async def _follow(api: Api, session: tuple[str, str], tally: Tally) -> None:
    """The session's events over SSE from its first, through either gateway, resuming after the
    last event id on any break, until the session is gone (or the task is cancelled): each
    `watch_fired` is kept in `tally.fired`."""
    sid, token = session
    last_id = None
    while True:
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        headers |= {"Last-Event-ID": last_id} if last_id else {}
        url = f"{api.urls[api.at]}/sessions/{sid}/events"
        try:
            timeout = httpx.Timeout(10, read=SSE_READ_S)
            async with api.http.stream("GET", url, params={} if last_id else {"since": "0"}, headers=headers, timeout=timeout) as reply:
                if reply.status_code in (401, 403, 404):
                    return
                if reply.status_code == 200:
                    decoder = SseDecoder()
                    async for line in reply.aiter_lines():
                        event = decoder.feed(line)
                        if event is None:
                            continue
                        last_id = event.id or last_id
                        if event.event == "gone":
                            return
                        if event.event == "watch_fired":
                            fired = event.json()
                            tally.fired[sid, fired["watch_id"]].append(fired["time_s"])
        except (httpx.HTTPError, ValueError):
            pass
        api.at = (api.at + 1) % len(api.urls)
        await asyncio.sleep(0.5)


async def _failed(api: Api, session: tuple[str, str], tally: Tally) -> bool:
    """Whether the session turned `error` or is gone (then it is counted as failed)."""
    sid, token = session
    try:
        reply = await api.call("GET", f"/sessions/{sid}", token)
    except httpx.TransportError:
        return False
    state = reply.json().get("state") if reply.status_code == 200 else f"http_{reply.status_code}"
    if state == "error" or reply.status_code in (401, 404):
        tally.failed[sid] = state if state != "error" else f"error: {reply.json().get('error')}"
        return True
    return False


async def _show_frame(api: Api, session: tuple[str, str]) -> None:
    """One frame into the session, over a `frames` socket, and wait until it is in the cache."""
    sid, token = session
    url = api.urls[api.at].replace("http://", "ws://") + f"/sessions/{sid}/stream?token={token}"
    async with websockets.connect(url, max_size=None, open_timeout=10) as socket:
        await socket.send(json.dumps({"type": "start", "format": "frames"}))
        await socket.send(frame_message(0.0, _jpeg(0)))
        await socket.send(json.dumps({"type": "end"}))
        async with asyncio.timeout(CALL_TIMEOUT_S):
            async for message in socket:
                event = json.loads(message)
                if (event.get("type"), event.get("state")) == ("state", "ingested"):
                    return
    raise OSError("the idle session's frame was not ingested")


async def _drain(socket) -> None:
    """Read (and drop) the socket's events, so that the gateway never waits on this client."""
    async for _ in socket:
        pass
    raise OSError("the socket closed")


async def _uploader(api: Api, tally: Tally, stop: asyncio.Event, video: bytes, store: aioredis.Redis, prefix: str) -> None:
    while not stop.is_set():
        try:
            sid, token = session = await api.create(fps=UPLOAD_FPS)
        except httpx.HTTPError:
            tally.counts["uploads_not_created"] += 1
            await asyncio.sleep(1.0)
            continue
        tally.counts["uploads"] += 1
        await _add_watch(api, session, tally, LEAST_THRESHOLD)
        follower = asyncio.create_task(_follow(api, session, tally))
        if not await _upload(api, session, video):
            tally.counts["uploads_refused"] += 1
        else:
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while (found := (await api.call("GET", f"/sessions/{sid}", token)).json()).get("state") not in ("ingested", "error"):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.3)
            if found.get("state") == "error":
                tally.failed[sid] = f"error: {found.get('error')}"
            if found.get("frames_ingested") != UPLOAD_SECONDS * UPLOAD_FPS:
                tally.uploads_off.append((sid, found.get("frames_ingested")))
            for _ in range(2):
                await api.ask(session, tally, "What happened?")
        await _judge_watches(api, session, tally)
        follower.cancel()
        await _judge(store, prefix, sid, tally)
        await api.call("DELETE", f"/sessions/{sid}", token)


async def _upload(api: Api, session: tuple[str, str], video: bytes) -> bool:
    """Upload, again while the last try's outcome is unknown; 409 (media_exists) while an upload
    cut by a dead gateway has not been given up yet, or when the last try went through."""
    sid, token = session
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            reply = await api.call("POST", f"/sessions/{sid}/upload", token, content=video)
        except httpx.TransportError:
            continue
        if reply.status_code == 202:
            return True
        if reply.status_code == 409 and (await api.call("GET", f"/sessions/{sid}", token)).json().get("upload_ended"):
            return True
        await asyncio.sleep(1.0)
    return False


async def _chatter(api: Api, tally: Tally, stop: asyncio.Event, rng: random.Random) -> None:
    """A chat user: a completion about one of CHAT_IMAGES, or about an image the worker refuses."""
    images = [_data_url(_jpeg(1000 + i), "image/jpeg") for i in range(CHAT_IMAGES)]
    refused_image = _data_url(_huge_png(), "image/png")
    while not stop.is_set():
        refused = rng.random() < CHAT_REFUSED_SHARE
        url = refused_image if refused else rng.choice(images)
        content = [{"type": "text", "text": "What is in the picture?"}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"model": CHAT_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
        started = time.monotonic()
        try:
            reply = await api.call("POST", "/v1/chat/completions", json=body)  # a 503 or a gateway down: again
            outcome, code = reply.status_code, reply.json().get("error", {}).get("code") if reply.status_code != 200 else None
        except (httpx.TransportError, ValueError) as err:
            reply, outcome, code = None, type(err).__name__, None
        if refused:
            right = (outcome, code) == (400, "invalid_media")
            tally.counts["chat_refused_right" if right else "chat_refused_wrong"] += 1
            tally.chat_refused_s.append(round(time.monotonic() - started, 2))
            if not right:
                tally.chat_wrong.append(f"refused image: {outcome} {code}")
        elif outcome == 200:
            tally.counts["chat_answered"] += 1
            answered = reply.json()
            tally.asked[answered["streamvqa"]["answer_id"]] = answered["session_id"]
            tally.chats.add(answered["session_id"])
        else:
            tally.counts["chat_failed"] += 1
            tally.chat_wrong.append(f"image: {outcome} {code}")
        try:
            await asyncio.wait_for(stop.wait(), CHAT_EVERY_S)
        except TimeoutError:
            pass


async def _recovered(api: Api, sessions: list[tuple[str, str]], tally: Tally) -> None:
    """Until every session answers a question (a session found failed is counted as such, not waited for)."""
    while True:
        live = [session for session in sessions if session[0] not in tally.failed]
        results = await asyncio.gather(*(api.ask(session, tally, "Still there?") for session in live))
        if all(result == "done" for result in results):
            return
        for session, result in zip(live, results):
            if result == "session_error":
                await _failed(api, session, tally)


async def _faults(deployment: Deployment, api: Api, probes: list[tuple[str, str]], tally: Tally,
                  stop: asyncio.Event, args: argparse.Namespace, rng: random.Random) -> None:
    kinds = args.faults.split(",")
    while True:
        try:
            await asyncio.wait_for(stop.wait(), args.fault_every * rng.uniform(0.5, 1.5))
            return
        except TimeoutError:
            pass
        kind = rng.choice(kinds)
        name = {"worker": f"worker{rng.randrange(2)}", "gateway": f"gateway{rng.randrange(2)}"}.get(kind, "redis")
        killed_at = time.monotonic()
        deployment.kill(name)
        await asyncio.sleep(rng.uniform(1, 3))
        deployment.restart(name)
        try:
            await asyncio.wait_for(_recovered(api, probes, tally), RECOVERY_LIMIT_S)
            tally.recoveries.append((name, round(time.monotonic() - killed_at, 2)))
        except TimeoutError:
            tally.recoveries.append((name, None))
        print(json.dumps({"fault": name, "recovered_s": tally.recoveries[-1][1]}), flush=True)


async def _run(deployment: Deployment, args: argparse.Namespace, tally: Tally) -> None:
    stop, rng = asyncio.Event(), random.Random(args.seed)
    video = _video()
    store = aioredis.Redis.from_url(deployment.env["REDIS_URL"])
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as http:
        apis = [Api(http, deployment.urls, random.Random(args.seed + i)) for i in range(args.streamers + args.uploaders + 2)]
        idle = await apis[-1].create(fps=1.0)
        await _show_frame(apis[-1], idle)  # a question needs video to be about
        streamers = [asyncio.create_task(_streamer(apis[i], tally, stop, random.Random(i))) for i in range(args.streamers)]
        while len(tally.streams) < args.streamers:  # their sessions exist
            await asyncio.sleep(0.1)
        probes = [idle, *tally.streams.items()]
        uploaders = [
            asyncio.create_task(_uploader(apis[args.streamers + i], tally, stop, video, store, deployment.prefix))
            for i in range(args.uploaders)
        ]
        idle_asker = asyncio.create_task(_asking(apis[-1], idle, tally, stop, 30.0))
        chatters = [
            asyncio.create_task(_chatter(Api(http, deployment.urls, random.Random(args.seed + 100 + i)), tally, stop,
                                         random.Random(args.seed + 200 + i)))
            for i in range(args.chatters)
        ]
        faults = asyncio.create_task(_faults(deployment, apis[-2], probes, tally, stop, args, rng))
        await asyncio.sleep(args.seconds)
        stop.set()
        ends_at = time.monotonic() + args.grace_s
        clients = [faults, *streamers, *uploaders, idle_asker, *chatters]
        _, busy = await asyncio.wait(clients, timeout=max(1.0, ends_at - FINAL_S - time.monotonic()))
        for task in busy:
            task.cancel()
        tally.counts["clients_cut"] += len(busy)
        for task in clients:
            if task not in busy and task.exception() is not None:
                tally.counts["client_errors"] += 1
                print(json.dumps({"client_error": repr(task.exception())}), flush=True)
        try:
            await asyncio.wait_for(_end_states(apis[-1], probes, tally), max(1.0, ends_at - time.monotonic()))
        except TimeoutError:
            tally.counts["end_not_checked"] += 1
        streams = [session for session in tally.streams.items() if session[0] not in tally.failed]
        try:
            await asyncio.wait_for(asyncio.gather(*(_judge_watches(apis[-1], s, tally) for s in streams)),
                                   max(WATCH_SETTLE_S + 15, ends_at - time.monotonic()))
        except TimeoutError:
            pass  # what was not judged is counted unjudged
        for follower in tally.followers:
            follower.cancel()
        tally.mean_batch = await _mean_batch(http, deployment.urls)
        for sid in [sid for sid, _ in probes] + sorted(tally.chats):
            await _judge(store, deployment.prefix, sid, tally)
        await _frames(store, deployment.prefix, tally)
    await store.aclose()


async def _end_states(api: Api, probes: list[tuple[str, str]], tally: Tally) -> None:
    """A last question to every live session, then each one's state: none left `pending` or
    `ingesting`, and each stream's video time."""
    live = [session for session in probes if session[0] not in tally.failed]
    final = await asyncio.gather(*(api.ask(session, tally, "Last question?") for session in live))
    tally.counts["stuck_last_question"] = sum(result != "done" for result in final)

    async def settled(sid: str, token: str) -> None:
        deadline = time.monotonic() + DRAIN_S
        while True:
            found = (await api.call("GET", f"/sessions/{sid}", token)).json()
            if sid in tally.streams:
                tally.video_s[sid] = found.get("video_time_s")
            if found.get("state") == "error":
                tally.failed.setdefault(sid, f"error: {found.get('error')}")
            if found.get("state") not in ("pending", "ingesting"):
                return
            if time.monotonic() > deadline:
                tally.counts["stuck_state"] += 1
                return
            await asyncio.sleep(0.5)

    await asyncio.gather(*(settled(sid, token) for sid, token in probes))


async def _mean_batch(http: httpx.AsyncClient, urls: list[str]) -> float | None:
    """Sessions per engine step, over the workers alive now (their counters start with them)."""
    for url in urls:
        try:
            text = (await http.get(f"{url}/metrics")).text
        except httpx.HTTPError:
            continue
        sums = Counter()
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in ("streamvqa_worker_steps_total", "streamvqa_worker_step_sessions_total"):
                sums[name] += float(line.rsplit(" ", 1)[1])
        steps = sums["streamvqa_worker_steps_total"]
        return round(sums["streamvqa_worker_step_sessions_total"] / steps, 2) if steps else None
    return None


async def _judge(store: aioredis.Redis, prefix: str, sid: str, tally: Tally) -> None:
    """Each asked answer of the session, as Redis holds it (before the session is deleted)."""
    for answer_id in [a for a, s in tally.asked.items() if s == sid and a not in tally.judged]:
        stored = None
        for _ in range(60):  # Redis may be being restarted: 30 s at most
            try:
                stored = await store.xrange(f"{prefix}session:{{{sid}}}:answer:{answer_id}")
                break
            except RedisError:
                await asyncio.sleep(0.5)
        if stored is None:
            continue  # counted as unjudged
        events = [AnswerEnvelope.model_validate_json(f[b"m"]).event for _, f in stored]
        finals = [e for e in events if e.type != "token"]
        tokens = sum(e.type == "token" for e in events)
        if not finals:
            verdict = "lost"
        elif len(finals) > 1 or (finals[0].type == "done" and tokens > finals[0].tokens):
            verdict = "answered_twice"
        elif finals[0].type == "done":
            verdict = "answered"
        else:
            verdict = "reset" if finals[0].code == "session_reset" else f"error_{finals[0].code}"
        tally.judged[answer_id] = verdict


async def _frames(store: aioredis.Redis, prefix: str, tally: Tally) -> None:
    """Each stream's frames: sent, in the cache (the worker's count), and which times its ingest
    events name. A time can be named twice without being in the cache twice: frames a dead worker
    appended after its last snapshot are appended again by the worker that takes over."""
    frames = tally.frames
    for sid, sent in tally.sent.items():
        events = {}
        for _, fields in await store.xrange(f"{prefix}session:{{{sid}}}:events"):
            event = EventEnvelope.model_validate_json(fields[b"m"]).event
            if event.type == "ingest":
                events[event.frames] = event.times
        times = [t for batch in events.values() for t in batch]
        counted = int(await store.hget(f"{prefix}session:{{{sid}}}", "frames_ingested") or 0)
        frames["dropped"] += int(await store.hget(f"{prefix}session:{{{sid}}}", "frames_dropped") or 0)  # the worker's live bound
        frames["sent"] += len(sent)
        frames["ingested"] += counted
        frames["duplicated"] += max(0, counted - len(set(times)))  # in the cache more than once
        frames["lost"] += len(sent - set(times))
        tally.lost_frames += sorted(sent - set(times))


def firing_counts(tally: Tally) -> dict[str, int]:
    """The watches' firings: those that had to come, and those lost, sent twice, or sent and not recorded."""
    counts = Counter({"watches": len(tally.watches), "firings": sum(len(times) for times in tally.fired.values()),
                      **dict.fromkeys(("firings_due", "firings_lost", "firings_twice", "firings_unrecorded", "watches_unjudged"), 0)})
    for key, watched in tally.watches.items():
        sent = tally.fired.get(key, [])
        counts["firings_twice"] += len(sent) - len(set(sent))
        if watched.fired_s is None:
            counts["watches_unjudged"] += 1
            continue
        recorded = set(watched.fired_s)
        if watched.threshold == LEAST_THRESHOLD:
            counts["firings_twice"] += max(0, len(recorded) - 1)  # it cannot fire again: a check redone
        if watched.must_fire:
            counts["firings_due"] += 1
            counts["firings_lost"] += not recorded
        counts["firings_lost"] += len(recorded - set(sent))
        counts["firings_unrecorded"] += len(set(sent) - recorded)
    return dict(counts)


def summary(args: argparse.Namespace, tally: Tally, error: str | None, wall_s: float, logs: str) -> dict:
    """The run's one JSON line: every counter, 0 or not (see the module's text)."""
    recoveries = [seconds for _, seconds in tally.recoveries]
    recovered = [seconds for seconds in recoveries if seconds is not None]
    verdicts = Counter(tally.judged.values())
    return {
        "seconds": args.seconds, "fsync": args.fsync, "lease_ttl_s": args.lease_ttl_s,
        "faults": dict(Counter(name.rstrip("01") for name, _ in tally.recoveries)),
        "recovery_max_s": max(recovered, default=None), "not_recovered": len(recoveries) - len(recovered),
        "recoveries_s": recoveries,
        "asked": len(tally.asked), **{verdict: verdicts[verdict] for verdict in VERDICTS},
        **{verdict: count for verdict, count in verdicts.items() if verdict not in VERDICTS},
        "unjudged": len(set(tally.asked) - set(tally.judged)),
        **{f"frames_{name}": tally.frames[name] for name in FRAME_COUNTS}, "lost_frame_times": tally.lost_frames[:20],
        "uploads_wrong_frames": len(tally.uploads_off),
        "stuck": tally.counts["stuck_last_question"] + tally.counts["stuck_state"],
        "failed_sessions": len(tally.failed), "failed": dict(list(tally.failed.items())[:10]),
        "streams_video_s": sorted(tally.video_s.values(), key=lambda t: t or 0), "mean_batch": tally.mean_batch,
        **{name: tally.counts[name] for name in COUNTERS},
        "chat_refused_max_s": max(tally.chat_refused_s, default=None), "chat_wrong": tally.chat_wrong[:10],
        **firing_counts(tally),
        **{k: v for k, v in tally.counts.items() if k.startswith(("ask_refused", "watch_refused"))},
        "error": error, "wall_s": round(wall_s, 1), "logs": logs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--grace-s", type=float, default=300.0, help="the most the end may take after --seconds")
    parser.add_argument("--streamers", type=int, default=3)
    parser.add_argument("--uploaders", type=int, default=2)
    parser.add_argument("--chatters", type=int, default=1, help="chat users, each asking about images (some refused)")
    parser.add_argument("--fault-every", type=float, default=30.0)
    parser.add_argument("--faults", default="worker,gateway,redis")
    parser.add_argument("--fsync", default="always", choices=["always", "everysec"])
    parser.add_argument("--lease-ttl-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="streamvqa-chaos-"))
    deployment = Deployment(folder, args)
    started, tally, error = time.monotonic(), Tally(), None
    try:
        deployment.start()
        asyncio.run(asyncio.wait_for(_run(deployment, args, tally), args.seconds + args.grace_s + 60))
    except BaseException as err:  # the summary says what was tallied before it
        error = repr(err)
    finally:
        deployment.stop()
    print(json.dumps(summary(args, tally, error, time.monotonic() - started, str(folder))), flush=True)


if __name__ == "__main__":
    main()
