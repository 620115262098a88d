"""The gateway's own cost, as ratios against a bare app doing the same Redis work in the same run.

    python -m bench.gateway [--frames 2000] [--rounds 5] [--asks 100] [--frame-kb 40] [--deflate]

Starts Redis (REDIS_URL, else an embedded server), one worker serving `tiny-random-llava`, the
gateway (`python -m app`), and the baseline: `_baseline_app` below, a bare Starlette app served by
its own uvicorn process, with a bare consumer process (`--consume`) in the worker's place on the
baseline's streams. Gateway and baseline alternate within each round, in turns, so that both see
the same machine at the same moment; medians are reported. The gateway's rate limits are set so
high that they never refuse: their checks still run and are measured.

- `ws_ingest_frames_per_s`, `ws_ingest_mb_per_s`: one client streams `--frames` `frames`
  messages (an 8-byte capture time, then one 640x480 JPEG of about `--frame-kb` KiB) over one
  WebSocket as fast as the server and its backpressure allow. The clock runs from the first send
  until every byte is counted in Redis: the session's `stream_bytes`, which the gateway raises in
  the same script as each XADD; the baseline raises a counter in the same round trip as its XADD.
  The gateway's session samples 1 frame a second (the default fps), as a fast camera would be
  sampled; the worker reads, acknowledges and deletes every entry, as the bare consumer does.
  Also reported, per frame and process: CPU milliseconds (server, consumer, Redis, client), and
  the server's alone as `ws_ingest_server_cpu_ms_per_frame` (the gateway's own cost). The
  client sends uncompressed messages; `--deflate` negotiates permessage-deflate, as browsers do
  when a server accepts it (the gateway is started with WS_PER_MESSAGE_DEFLATE=true for that
  run), so that each frame is deflated and inflated on the way.
- `ask_overhead_ms`: `POST /sessions/{id}/ask` with `max_new_tokens` 1: the client's round trip
  minus the consumer's own time (the worker's `worker_ms`, read from the answer stream; the bare
  consumer's, likewise). What is left: HTTP, the gateway's checks and Redis round trips, and the
  consumer noticing the question. Baseline: a bare `POST` that XADDs the question and XREADs the
  reply stream, answered at once by the bare consumer.
- `get_session_ms`: `GET /sessions/{id}` (rate limit, bearer check, HGETALL, idle-clock refresh,
  the record as JSON) against a bare `GET` doing one HGETALL of a copy of the same hash.

Prints one JSON line per metric: `metric`, `value` (gateway), `baseline`, `ratio` (value over
baseline), and for ingest every round's values. MB is 10^6 bytes.

One module, over 400 lines: the baseline app and consumer sit beside the measurements, so that what is compared is in one file.
"""

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np
import redis.asyncio
import websockets
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from bench.common import emit
from streamvqa import children, protocol
from streamvqa.protocol import frame_message
from streamvqa.redis_server import EmbeddedRedis, free_port
from streamvqa.run import wait_until_serving

BASELINE_PREFIX = "BENCH_BASELINE_PREFIX"  # environment variable: the baseline's key prefix
CONSUMER_READ_COUNT = 8  # entries per stream per read, as the worker reads
CONSUMER_BLOCK_MS = 50
WARMUP_CALLS = 5  # of each kind, not measured
NEVER_LIMITED = "1000000"  # a rate the gateway's limits never reach
START_TIMEOUT_S = 300
SIDES = ("gateway", "baseline")


class BaselineKeys:
    """The baseline's keys: one media stream, its byte counter, a question stream, answer streams."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.media = f"{prefix}baseline:media"
        self.media_bytes = f"{prefix}baseline:media_bytes"
        self.questions = f"{prefix}baseline:questions"
        self.session = f"{prefix}baseline:session"

    def answer(self, answer_id: str) -> str:
        return f"{self.prefix}baseline:answer:{answer_id}"


# -- the baseline: a bare app and a bare consumer ------------------------------------------------


def _baseline_app() -> Starlette:
    """What the gateway does per message and per request, minimally: no auth, no validation, no
    session state; the same media backlog rule (wait at MEDIA_BACKLOG_ENTRIES, resume at half).
    Served by `uvicorn --factory bench.gateway:_baseline_app`."""
    keys = BaselineKeys(os.environ[BASELINE_PREFIX])
    client = redis.asyncio.Redis.from_url(os.environ["REDIS_URL"])

    async def stream(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                message = await websocket.receive_bytes()
                if await client.xlen(keys.media) >= protocol.MEDIA_BACKLOG_ENTRIES:
                    await websocket.send_json({"type": "backpressure", "paused": True})
                    while await client.xlen(keys.media) >= protocol.MEDIA_BACKLOG_ENTRIES // 2:
                        await asyncio.sleep(0.05)
                    await websocket.send_json({"type": "backpressure", "paused": False})
                async with client.pipeline(transaction=False) as pipe:
                    pipe.xadd(keys.media, protocol.MediaEntry(protocol.MediaKind.FRAME, data=message).fields(), maxlen=protocol.MEDIA_MAXLEN, approximate=True)
                    pipe.incrby(keys.media_bytes, len(message))
                    await pipe.execute()
        except WebSocketDisconnect:
            pass

    async def ask(request: Request) -> JSONResponse:
        body = await request.json()
        answer_id = uuid.uuid4().hex
        question = {"answer_id": answer_id, "question": body["question"], "max_new_tokens": body["max_new_tokens"]}
        await client.xadd(keys.questions, {"m": json.dumps(question)})
        reply = await client.xread({keys.answer(answer_id): "0-0"}, block=10_000, count=1)
        return JSONResponse({"answer_id": answer_id, **json.loads(reply[0][1][0][1][b"m"])["event"]})

    async def session(request: Request) -> JSONResponse:
        fields = await client.hgetall(keys.session)
        return JSONResponse({k.decode(): v.decode() for k, v in fields.items()})

    routes = [WebSocketRoute("/stream", stream), Route("/ask", ask, methods=["POST"]), Route("/session", session)]
    return Starlette(routes=routes)


async def _consume(redis_url: str, keys: BaselineKeys) -> None:
    """The worker's part on the baseline's streams, and nothing else: media entries are
    acknowledged and deleted, each question gets a one-token `done` answer at once."""
    client = redis.asyncio.Redis.from_url(redis_url)
    for stream in (keys.media, keys.questions):
        await client.xgroup_create(stream, protocol.GROUP, id="0", mkstream=True)
    streams = {keys.media: ">", keys.questions: ">"}
    while True:
        reply = await client.xreadgroup(protocol.GROUP, "bench", streams, count=CONSUMER_READ_COUNT, block=CONSUMER_BLOCK_MS)
        for stream, entries in reply:
            if stream.decode() == keys.questions:
                for _, fields in entries:
                    started = time.monotonic()
                    question = json.loads(fields[b"m"])
                    done = {"type": "done", "answer": "a", "tokens": 1, "video_time_s": 0.0, "cache_tokens": 0}
                    done["worker_ms"] = (time.monotonic() - started) * 1000
                    await client.xadd(keys.answer(question["answer_id"]), {"m": json.dumps({"event": done})})
            ids = [entry_id for entry_id, _ in entries]
            async with client.pipeline(transaction=False) as pipe:
                pipe.xack(stream, protocol.GROUP, *ids)
                pipe.xdel(stream, *ids)
                await pipe.execute()


# -- measuring -------------------------------------------------------------------------------


def _jpeg(target_kib: float) -> bytes:
    """A 640x480 JPEG of about `target_kib` KiB: a smooth scene with noise, the noise found by
    bisection (a camera's JPEGs at this size are 30-60 KiB)."""
    y, x = np.mgrid[0:480, 0:640]
    scene = np.stack([x * 255 / 640, y * 255 / 480, (x + y) * 255 / 1120], axis=-1)  # (480, 640, 3)
    noise = np.random.default_rng(0).standard_normal(scene.shape)
    low, high = 0.0, 128.0
    for _ in range(12):
        sigma = (low + high) / 2
        buffer = io.BytesIO()
        Image.fromarray(np.clip(scene + sigma * noise, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=85)
        low, high = (low, sigma) if buffer.tell() > target_kib * 1024 else (sigma, high)
    return buffer.getvalue()


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _stream_frames(
    url: str, jpeg: bytes, frames: int, counted: Callable[[], Awaitable[int]], start: bool, deflate: bool,
    cpu_s: Callable[[], dict[str, float]],
) -> tuple[float, int, dict[str, float]]:
    """Send `frames` timed frames as fast as backpressure allows; the seconds from the first send
    until the server has counted every byte in Redis, the number of pauses, and the CPU seconds
    `cpu_s` counted meanwhile."""
    compression = "deflate" if deflate else None
    async with websockets.connect(url, max_size=None, compression=compression) as socket:
        if start:
            await socket.send(json.dumps({"type": "start", "format": "frames"}))
            started = json.loads(await socket.recv())
            assert started["type"] == "started", started
        go = asyncio.Event()
        go.set()
        pauses = 0

        async def events() -> None:
            nonlocal pauses
            async for message in socket:
                event = json.loads(message)
                if event["type"] == "backpressure":
                    pauses += event["paused"]
                    go.clear() if event["paused"] else go.set()
                elif event["type"] == "error":
                    raise RuntimeError(f"the server sent {event}")

        reader = asyncio.create_task(events())
        before, total = await counted(), 0
        cpu_before = cpu_s()
        t0 = time.monotonic()
        for _ in range(frames):
            await go.wait()
            message = frame_message(time.monotonic() - t0, jpeg)  # its capture time: sampled at the session's fps
            await socket.send(message)
            total += len(message)
        while await counted() < before + total:
            if reader.done():
                reader.result()  # the server closed the socket: say why
            await asyncio.sleep(0.002)
        elapsed_s = time.monotonic() - t0
        cpu_used = {name: used - cpu_before[name] for name, used in cpu_s().items()}
        reader.cancel()
    return elapsed_s, pauses, cpu_used


async def _ready_session(http: httpx.AsyncClient, gateway: str) -> tuple[str, dict[str, str]]:
    """A new session with the default options, once the worker holds it; its id and auth header."""
    created = (await http.post(f"{gateway}/sessions", json={})).json()
    session_id, auth = created["id"], {"Authorization": f"Bearer {created['token']}"}
    deadline = time.monotonic() + 30
    while (await http.get(f"{gateway}/sessions/{session_id}", headers=auth)).json()["state"] != "ready":
        if time.monotonic() > deadline:
            raise RuntimeError(f"session {session_id} never became ready")
        await asyncio.sleep(0.05)
    return session_id, auth


class Bench:
    """The measurements, against a running gateway and baseline."""

    def __init__(self, args: argparse.Namespace, urls: dict[str, str], redis_url: str, prefix: str, pids: dict[str, int]) -> None:
        self.args = args
        self.urls = urls  # side -> base URL
        self.pids = pids  # gateway, baseline, worker, consumer, redis (if embedded), client
        self.store = redis.asyncio.Redis.from_url(redis_url)
        self.keys, self.baseline_keys = protocol.Keys(prefix), BaselineKeys(prefix)
        self.jpeg = _jpeg(args.frame_kb)
        self.http = httpx.AsyncClient(timeout=60)

    async def run(self) -> None:
        try:
            await self.ingest()
            await self.rest()
        finally:
            await self.http.aclose()
            await self.store.aclose()

    async def ingest(self) -> None:
        rates: dict[str, list[float]] = {side: [] for side in SIDES}
        pauses = dict.fromkeys(SIDES, 0)
        cpu_ms = {side: dict.fromkeys(("server", "consumer", "redis", "client"), 0.0) for side in SIDES}
        processes = {
            "gateway": {"server": "gateway", "consumer": "worker", "redis": "redis", "client": "client"},
            "baseline": {"server": "baseline", "consumer": "consumer", "redis": "redis", "client": "client"},
        }
        for index in range(self.args.rounds):
            for side in SIDES if index % 2 == 0 else reversed(SIDES):
                pids = {role: self.pids[name] for role, name in processes[side].items() if name in self.pids}

                def cpu_s() -> dict[str, float]:
                    return {role: _cpu_s(pid) for role, pid in pids.items()}

                round_ = self._gateway_round if side == "gateway" else self._baseline_round
                elapsed_s, paused, used = await round_(cpu_s)
                for role, seconds in used.items():
                    cpu_ms[side][role] += seconds * 1000
                rates[side].append(self.args.frames / elapsed_s)
                pauses[side] += paused
        frames = self.args.frames * self.args.rounds
        per_frame = {side: {role: round(ms / frames, 3) for role, ms in roles.items()} for side, roles in cpu_ms.items()}
        frame_bytes = len(frame_message(0.0, self.jpeg))
        _report("ws_ingest_frames_per_s", rates, frame_bytes=frame_bytes, pauses=pauses, cpu_ms_per_frame=per_frame)
        _report("ws_ingest_mb_per_s", {side: [r * frame_bytes / 1e6 for r in values] for side, values in rates.items()})
        server_ms = {side: [per_frame[side]["server"]] for side in SIDES}  # over all rounds: one value
        _report("ws_ingest_server_cpu_ms_per_frame", server_ms, per_round=False)

    async def _gateway_round(self, cpu_s: Callable[[], dict[str, float]]) -> tuple[float, int, dict[str, float]]:
        session_id, auth = await _ready_session(self.http, self.urls["gateway"])
        host = self.urls["gateway"].removeprefix("http://")
        url = f"ws://{host}/sessions/{session_id}/stream?token={auth['Authorization'][7:]}"

        async def counted() -> int:
            return int(await self.store.hget(self.keys.session(session_id), "stream_bytes") or 0)

        try:
            return await _stream_frames(url, self.jpeg, self.args.frames, counted, True, self.args.deflate, cpu_s)
        finally:
            await self.http.delete(f"{self.urls['gateway']}/sessions/{session_id}", headers=auth)

    async def _baseline_round(self, cpu_s: Callable[[], dict[str, float]]) -> tuple[float, int, dict[str, float]]:
        async def counted() -> int:
            return int(await self.store.get(self.baseline_keys.media_bytes) or 0)

        url = f"ws://{self.urls['baseline'].removeprefix('http://')}/stream"
        return await _stream_frames(url, self.jpeg, self.args.frames, counted, False, self.args.deflate, cpu_s)

    async def _first_frame(self, session_id: str, auth: dict[str, str]) -> None:
        """One frame into the session's cache, since a question before any is refused (409
        `no_video`)."""
        host = self.urls["gateway"].removeprefix("http://")
        url = f"ws://{host}/sessions/{session_id}/stream?token={auth['Authorization'][7:]}"
        async with websockets.connect(url, max_size=None) as socket:
            await socket.send(json.dumps({"type": "start", "format": "frames"}))
            await socket.recv()
            await socket.send(frame_message(0.0, self.jpeg))
            deadline = time.monotonic() + 30
            while int(await self.store.hget(self.keys.session(session_id), "frames_ingested") or 0) < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"session {session_id} never took its first frame")
                await asyncio.sleep(0.05)

    async def rest(self) -> None:
        """Asks and session reads, interleaved call by call, in alternating order."""
        gateway, baseline = self.urls["gateway"], self.urls["baseline"]
        session_id, auth = await _ready_session(self.http, gateway)
        await self._first_frame(session_id, auth)
        await self.store.hset(self.baseline_keys.session, mapping=await self.store.hgetall(self.keys.session(session_id)))
        body = {"question": "What is happening?", "max_new_tokens": 1}
        worker_ms: list[float] = []

        async def gateway_ask() -> float:
            started = time.monotonic()
            reply = await self.http.post(f"{gateway}/sessions/{session_id}/ask", json=body, headers=auth)
            elapsed_ms = (time.monotonic() - started) * 1000
            reply.raise_for_status()
            last = await self.store.xrevrange(self.keys.answer(session_id, reply.json()["answer_id"]), count=1)
            worker_ms.append(json.loads(last[0][1][b"m"])["event"]["worker_ms"])
            return elapsed_ms - worker_ms[-1]

        async def baseline_ask() -> float:
            started = time.monotonic()
            reply = await self.http.post(f"{baseline}/ask", json=body)
            elapsed_ms = (time.monotonic() - started) * 1000
            reply.raise_for_status()
            return elapsed_ms - reply.json()["worker_ms"]

        async def timed_get(url: str, headers: dict[str, str] | None = None) -> float:
            started = time.monotonic()
            (await self.http.get(url, headers=headers)).raise_for_status()
            return (time.monotonic() - started) * 1000

        calls = {
            ("ask", "gateway"): gateway_ask,
            ("ask", "baseline"): baseline_ask,
            ("get", "gateway"): lambda: timed_get(f"{gateway}/sessions/{session_id}", auth),
            ("get", "baseline"): lambda: timed_get(f"{baseline}/session"),
        }
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
        for index in range(WARMUP_CALLS + self.args.asks):
            for key in list(calls) if index % 2 == 0 else reversed(calls):
                value = await calls[key]()
                if index >= WARMUP_CALLS:
                    samples[key].append(value)
        await self.http.delete(f"{gateway}/sessions/{session_id}", headers=auth)
        asks = {side: samples["ask", side] for side in SIDES}
        _report("ask_overhead_ms", asks, per_round=False, calls=self.args.asks, worker_ms=statistics.median(worker_ms))
        _report("get_session_ms", {side: samples["get", side] for side in SIDES}, per_round=False, calls=self.args.asks)


def _report(metric: str, values: dict[str, list[float]], per_round: bool = True, **extra: object) -> None:
    """One JSON line: the medians of both sides, their ratio, and with `per_round` every value."""
    value, baseline = (statistics.median(values[side]) for side in SIDES)
    if per_round:
        extra["rounds"] = {side: [round(v, 3) for v in values[side]] for side in SIDES}
    emit(metric=metric, value=round(value, 3), baseline=round(baseline, 3), ratio=round(value / baseline, 3), **extra)


# -- processes -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=2000, help="frames per ingest round and side")
    parser.add_argument("--rounds", type=int, default=5, help="ingest rounds (each measures both sides)")
    parser.add_argument("--asks", type=int, default=100, help="asks and session reads per side")
    parser.add_argument("--frame-kb", type=float, default=40, help="size of each JPEG in KiB")
    parser.add_argument("--deflate", action="store_true", help="negotiate permessage-deflate, as browsers do")
    parser.add_argument("--consume", action="store_true", help=argparse.SUPPRESS)  # run as the bare consumer
    args = parser.parse_args()
    if args.consume:
        asyncio.run(_consume(os.environ["REDIS_URL"], BaselineKeys(os.environ[BASELINE_PREFIX])))
        return

    folder = Path(tempfile.mkdtemp(prefix="streamvqa-gateway-"))
    embedded = None if os.environ.get("REDIS_URL") else EmbeddedRedis(folder / "redis")
    redis_url = os.environ.get("REDIS_URL") or embedded.start()
    prefix = f"svqa-gateway-{uuid.uuid4().hex[:8]}:"
    ports = {side: free_port() for side in SIDES}
    env = {
        **os.environ, "REDIS_URL": redis_url, "REDIS_PREFIX": prefix, BASELINE_PREFIX: prefix,
        "PORT": str(ports["gateway"]), "LOG_LEVEL": "WARNING", "TORCH_THREADS": "1", "MODEL": "tiny-random-llava",
        "SPOOL_DIR": str(folder / "spool"), "SNAPSHOT_DIR": str(folder / "snapshots"),
        "RATE_LIMIT_PER_S": NEVER_LIMITED, "RATE_LIMIT_BURST": NEVER_LIMITED, "WS_MESSAGES_PER_S": NEVER_LIMITED,
        "WS_PER_MESSAGE_DEFLATE": "true" if args.deflate else "false",  # the baseline's uvicorn accepts it by default
    }
    baseline_server = [
        sys.executable, "-m", "uvicorn", "--factory", "bench.gateway:_baseline_app", "--host", "127.0.0.1",
        "--port", str(ports["baseline"]), "--log-level", "warning", "--ws-max-size", str(4 * 1024 * 1024),
    ]
    processes = {
        "worker": children.spawn([sys.executable, "-m", "worker"], env),
        "gateway": children.spawn([sys.executable, "-m", "app"], env),
        "baseline": children.spawn(baseline_server, env),
        "consumer": children.spawn([sys.executable, "-m", "bench.gateway", "--consume"], env),
    }
    try:
        urls = {side: f"http://127.0.0.1:{port}" for side, port in ports.items()}
        wait_until_serving(f"{urls['gateway']}/healthz", redis_url, prefix, list(processes.values()), START_TIMEOUT_S)
        wait_until_serving(f"{urls['baseline']}/session", redis_url, prefix, list(processes.values()), START_TIMEOUT_S)
        pids = {name: process.pid for name, process in processes.items()} | {"client": os.getpid()}
        if embedded is not None:
            pids["redis"] = embedded.pid
        asyncio.run(Bench(args, urls, redis_url, prefix, pids).run())
    finally:
        for process in reversed(processes.values()):
            children.stop(process)
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()
