"""Many sessions at once against real processes: questions answered, time to first token, ingest lag.

    python -m bench.load [--sessions 20] [--seconds 60] [--ask-every 5] [--fps 1] [--workers 1]
                         [--gateways 1] [--cluster]

Starts Redis (REDIS_URL, else an embedded server; with `--cluster`, a local Redis Cluster of 3
masters and 3 replicas, or the cluster REDIS_URL names), `--gateways` gateways and `--workers`
workers serving the built-in `tiny-random-llava` on loopback; sessions take the gateways in
turn. Each session streams JPEG frames over its stream socket in real time at `--fps` and asks
a question every `--ask-every` seconds (`POST /sessions/{id}/ask`; the first once a frame is in
the cache), for `--seconds`. Then every outstanding question is awaited. Prints one
JSON line: `redis`, `gateways`, `workers`, `sessions`, `seconds`, `asked`, `answered`, `failed`,
`failures` (failed questions by status and code), `ttft_p50_ms`, `ttft_p99_ms` (gateway to first
token, as `ask` reports it), `total_p99_ms`, `lag_p99_s` (how far behind real time frames reached
the cache), `frames`, `dropped`, and the peak RSS of each process in MiB.

    python -m bench.load --together 8,20 [--model streamvqa-demo] [--frames 8] [--rounds 3] [--answer-tokens 32]
                         [--budget 2048]

Concurrent asking instead: two stacks on one Redis, one worker batching sessions
(BATCH_SESSIONS=16, or the largest count if more) and one running a session at a time (BATCH_SESSIONS=1), each with the
largest count of `--together` sessions (of `--budget` tokens, without recall; each worker's KV_MEMORY 0.4 of the RAM
unless set) that have taken `--frames` frames; then, for each count
and round, that many sessions ask at the same moment, in one stack and then the other. Prints
per count and mode: `asked`, `answered`, `tokens`, `tokens_per_s` (answer tokens over the time
from the questions to the last answer), `decode_tokens_per_s` (tokens after each answer's first,
over the time from the first answer's first token to the last answer's end), `ttft_p50_ms`,
`ttft_p99_ms`, `total_p99_ms`; per count the ratios batched over sequential; and first, the
frames each stack's sessions took and dropped (the same frames, so the same answers). A
text-only model (`--model smollm2-135m-instruct --frames 0`) takes no frames; its answers run
to `--answer-tokens`.

    python -m bench.load --turns 16 [--model streamvqa-demo] [--frames 300] [--budget 256] [--host-budget 4096]

Sessions in turn instead: one stack, and `--turns` sessions one after another, each with recall
(a host tier of `--host-budget` tokens) taking `--frames` frames over its stream socket, asked one
question, then deleted; after each is gone from the worker (its pages back in both pools), the
worker's resident memory. Prints per session `rss_mib`, the tokens it held on the device and in
its host tier, and the pools' free pages; then the worker's pools as it states them at start
(`kv_pool_mib`, `host_pool_mib`), the resident memory after the 2nd and the last session, and
their ratio (`creep`: 1.0 is none).
"""

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import websockets

from bench.common import frame_jpeg
from bench.stack import serving
from streamvqa import children
from streamvqa.protocol import frame_message
from streamvqa.redis_server import EmbeddedRedis, LocalCluster, free_port
from streamvqa.run import wait_until_serving

TOGETHER_KV_MEMORY = "0.4"  # of the RAM, for each of --together's two workers (their sessions without recall)
QUESTIONS = ["What do you see?", "What changed?", "What colour is the bar?", "Is anything moving?"]


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


class Results:
    def __init__(self) -> None:
        self.asked = self.answered = self.failed = self.frames = self.dropped = 0
        self.failures: dict[str, int] = {}  # failed questions by status and code
        self.ttft_ms: list[float] = []
        self.total_ms: list[float] = []
        self.lag_s: list[float] = []


async def _session(http: httpx.AsyncClient, base: str, args: argparse.Namespace, results: Results) -> None:
    """One session through one gateway (`base`): created, streamed into, asked."""
    created = (await http.post(f"{base}/sessions", json={"fps": args.fps})).json()
    sid, token = created["id"], created["token"]
    url = f"ws://{base.removeprefix('http://')}/sessions/{sid}/stream?token={token}"
    asks: list[asyncio.Task] = []
    dropped = 0
    has_video = asyncio.Event()  # a question waits for the session's first frame (else: 409 no_video)

    async def ask(question: str) -> None:
        with contextlib.suppress(TimeoutError):  # no frame in a minute: asked anyway (and counted if refused)
            await asyncio.wait_for(has_video.wait(), 60)
        results.asked += 1
        reply = await http.post(
            f"{base}/sessions/{sid}/ask", json={"question": question, "max_new_tokens": 16},
            headers={"Authorization": f"Bearer {token}"}, timeout=600,
        )
        if reply.status_code == 200:
            results.answered += 1
            results.ttft_ms.append(reply.json()["ttft_ms"])
            results.total_ms.append(reply.json()["total_ms"])
        else:
            results.failed += 1
            reason = f"{reply.status_code} {reply.json().get('code', '') if reply.headers.get('content-type') == 'application/json' else ''}"
            results.failures[reason.strip()] = results.failures.get(reason.strip(), 0) + 1

    async with websockets.connect(url, max_size=None) as socket:
        await socket.send(json.dumps({"type": "start", "format": "frames"}))

        async def events() -> None:
            nonlocal dropped
            async for message in socket:
                event = json.loads(message)
                if event["type"] == "ingest":
                    has_video.set()
                    results.frames += len(event["times"])
                    results.lag_s.append(event["lag_s"])
                    dropped = event["dropped"]

        reader = asyncio.create_task(events())
        started = time.monotonic()
        frame = 0
        while (elapsed := time.monotonic() - started) < args.seconds:
            await socket.send(frame_message(elapsed, frame_jpeg(frame)))
            if frame % max(1, round(args.ask_every * args.fps)) == 0:
                asks.append(asyncio.create_task(ask(QUESTIONS[frame % len(QUESTIONS)])))
            frame += 1
            await asyncio.sleep(max(0.0, started + frame / args.fps - time.monotonic()))
        await asyncio.gather(*asks)
        reader.cancel()
    results.dropped += dropped


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024


def _watch_rss(pids: dict[str, int], peaks: dict[str, int], stop: threading.Event) -> None:
    while not stop.is_set():
        for name, pid in pids.items():
            try:
                peaks[name] = max(peaks.get(name, 0), _rss_bytes(pid))
            except (OSError, StopIteration):
                pass
        stop.wait(0.5)


async def _load(bases: list[str], args: argparse.Namespace) -> Results:
    results = Results()
    limits = httpx.Limits(max_connections=4 * args.sessions)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        await asyncio.gather(*(_session(http, bases[i % len(bases)], args, results) for i in range(args.sessions)))
    return results


async def _prepare(http: httpx.AsyncClient, base: str, frames: int, budget: int, **options: object) -> tuple[str, str]:
    """A session of `budget` tokens (and `options`) that has taken `frames` frames: (id, token)."""
    reply = await http.post(f"{base}/sessions", json={"fps": 1, "budget_tokens": budget, **options})
    if reply.status_code != 201:
        raise SystemExit(f"could not create a session: {reply.status_code} {reply.text}")
    sid, token = reply.json()["id"], reply.json()["token"]
    if not frames:  # held by the worker before anyone asks, so that opening it is not timed
        deadline = time.monotonic() + 120
        while (await http.get(f"{base}/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})).json()["state"] == "pending":
            if time.monotonic() > deadline:
                raise SystemExit(f"no worker took session {sid} within 120 s")
            await asyncio.sleep(0.05)
        return sid, token
    url = f"ws://{base.removeprefix('http://')}/sessions/{sid}/stream?token={token}"
    async with websockets.connect(url, max_size=None) as socket:
        sending = asyncio.Event()  # set while no `backpressure` event paused the client
        sending.set()

        async def listen() -> None:
            async for message in socket:
                event = json.loads(message)
                if event.get("type") == "backpressure":
                    (sending.clear if event["paused"] else sending.set)()
                if event.get("state") == "ingested":
                    return

        listener = asyncio.create_task(listen())
        await socket.send(json.dumps({"type": "start", "format": "frames"}))
        for frame in range(frames):
            await sending.wait()
            await socket.send(frame_message(float(frame), frame_jpeg(frame)))
            await asyncio.sleep(0)  # the listener reads what came meanwhile
        await socket.send(json.dumps({"type": "end"}))
        await listener
    return sid, token


async def _ask_at_once(http: httpx.AsyncClient, base: str, sessions: list[tuple[str, str]], tokens: int, round_: int) -> dict:
    """Every session asks at the same moment; what came back."""

    async def ask(index: int, sid: str, token: str) -> httpx.Response:
        question = QUESTIONS[(index + round_) % len(QUESTIONS)]
        return await http.post(
            f"{base}/sessions/{sid}/ask", json={"question": question, "max_new_tokens": tokens},
            headers={"Authorization": f"Bearer {token}"}, timeout=900,
        )

    started = time.monotonic()
    replies = await asyncio.gather(*(ask(i, sid, token) for i, (sid, token) in enumerate(sessions)))
    wall_s = time.monotonic() - started
    done = [reply.json() for reply in replies if reply.status_code == 200]
    # decoding: from the first answer's first token to the last answer's end
    decode_s = (max(d["total_ms"] for d in done) - min(d["ttft_ms"] for d in done)) / 1000 if done else 0.0
    return {"asked": len(replies), "answered": len(done), "tokens": sum(d["tokens"] for d in done), "wall_s": wall_s,
            "decoded": sum(d["tokens"] - 1 for d in done), "decode_s": decode_s,
            "ttft_ms": [d["ttft_ms"] for d in done], "total_ms": [d["total_ms"] for d in done]}


async def _frames_held(http: httpx.AsyncClient, base: str, sessions: list[tuple[str, str]]) -> tuple[int, int]:
    """Frames the sessions took, and dropped, by their records."""
    records = [
        (await http.get(f"{base}/sessions/{sid}", headers={"Authorization": f"Bearer {token}"})).json() for sid, token in sessions
    ]
    return sum(r["frames_ingested"] for r in records), sum(r["frames_dropped"] for r in records)


async def _together(bases: dict[str, str], args: argparse.Namespace) -> list[dict]:
    counts = [int(c) for c in args.together.split(",")]
    lines: list[dict] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4 * max(counts)), timeout=120) as http:
        sessions: dict[str, list[tuple[str, str]]] = {mode: [] for mode in bases}
        for mode, base in bases.items():  # one at a time, so that no live frame comes late and is dropped
            for _ in range(max(counts)):
                sessions[mode].append(await _prepare(http, base, args.frames, args.budget, recall=False))
        for mode, base in bases.items():
            frames, dropped = await _frames_held(http, base, sessions[mode])
            lines.append({"mode": mode, "sessions": max(counts), "frames_taken": frames, "frames_dropped": dropped})
        for count in counts:
            runs: dict[str, list[dict]] = {mode: [] for mode in bases}
            for round_ in range(args.rounds):
                for mode, base in bases.items():  # alternating, so that a busy machine slows both alike
                    runs[mode].append(await _ask_at_once(http, base, sessions[mode][:count], args.answer_tokens, round_))
            rates = {}
            for mode, rounds in runs.items():
                ttft = [t for r in rounds for t in r["ttft_ms"]]
                line = {
                    "sessions": count, "mode": mode, "rounds": args.rounds,
                    "asked": sum(r["asked"] for r in rounds), "answered": sum(r["answered"] for r in rounds),
                    "tokens": sum(r["tokens"] for r in rounds),
                    "tokens_per_s": round(sum(r["tokens"] for r in rounds) / sum(r["wall_s"] for r in rounds), 2),
                    "decode_tokens_per_s": round(sum(r["decoded"] for r in rounds) / sum(r["decode_s"] for r in rounds), 2),
                    "ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
                    "total_p99_ms": _percentile([t for r in rounds for t in r["total_ms"]], 99),
                }
                rates[mode] = line
                lines.append(line)
            batched, sequential = rates["batched"], rates["sequential"]
            lines.append({
                "sessions": count,
                "tokens_per_s_batched_over_sequential": round(batched["tokens_per_s"] / sequential["tokens_per_s"], 2),
                "decode_tokens_per_s_batched_over_sequential": round(
                    batched["decode_tokens_per_s"] / sequential["decode_tokens_per_s"], 2
                ),
                "ttft_p99_sequential_over_batched": round(sequential["ttft_p99_ms"] / batched["ttft_p99_ms"], 2),
            })
    return lines


async def _worker_memory(http: httpx.AsyncClient, base: str) -> dict:
    (model,) = (await http.get(f"{base}/models")).json()["models"]
    (memory,) = model["memory"]
    return memory


def _leased(memory: dict) -> bool:
    """Whether a session leases pages of the worker's pools (GET /models names only the caller's
    sessions, and a deleted one's token names none: the pages free tell)."""
    return memory["pool_free_pages"] < memory["pool_pages"] or memory.get("host_pool_free_pages", 0) < memory.get("host_pool_pages", 0)


async def _turns(base: str, worker_pid: int, args: argparse.Namespace) -> dict:
    """Prints each session's line as it ends; returns the summary."""
    after = []
    async with httpx.AsyncClient(timeout=900) as http:
        for turn in range(args.turns):
            sid, token = await _prepare(
                http, base, args.frames, args.budget, recall=True, host_budget_tokens=args.host_budget,
            )
            auth = {"Authorization": f"Bearer {token}"}
            reply = await http.post(f"{base}/sessions/{sid}/ask", headers=auth,
                                    json={"question": QUESTIONS[turn % len(QUESTIONS)], "max_new_tokens": 8})
            memory = (await http.get(f"{base}/sessions/{sid}/memory", headers=auth)).json()
            await http.delete(f"{base}/sessions/{sid}", headers=auth)
            deadline = time.monotonic() + 60
            while _leased(pools := await _worker_memory(http, base)):  # the session was the worker's only one
                if time.monotonic() > deadline:
                    raise SystemExit(f"the worker still holds session {sid} 60 s after it was deleted")
                await asyncio.sleep(0.1)
            after.append(_rss_bytes(worker_pid))
            print(json.dumps({
                "session": turn + 1, "answered": reply.status_code == 200, "rss_mib": round(after[-1] / 2**20, 1),
                "cache_tokens": memory["cache_tokens"], "host_tokens": memory["host_tokens"],
                "host_mib": round(memory["host_bytes"] / 2**20, 1), "evictions": memory["evictions"],
                "pool_free_pages": pools["pool_free_pages"], "host_pool_free_pages": pools.get("host_pool_free_pages"),
            }), flush=True)
        return {
            "model": args.model, "sessions": args.turns, "frames": args.frames, "budget_tokens": args.budget,
            "host_budget_tokens": args.host_budget, "kv_pool_mib": round(pools["pool_bytes"] / 2**20, 1),
            "host_pool_mib": round(pools.get("host_pool_bytes", 0) / 2**20, 1),
            "rss_after_second_mib": round(after[min(1, len(after) - 1)] / 2**20, 1),
            "rss_after_last_mib": round(after[-1] / 2**20, 1), "creep": round(after[-1] / after[min(1, len(after) - 1)], 3),
        }


def turns(args: argparse.Namespace) -> None:
    """Sessions in turn through one stack: the worker's resident memory after each."""
    with serving("load", args.model) as stack:
        print(json.dumps(asyncio.run(_turns(stack.base, stack.worker.pid, args))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--ask-every", type=float, default=5.0, help="seconds between questions per session")
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--gateways", type=int, default=1)
    parser.add_argument("--cluster", action="store_true", help="a Redis Cluster (a local one unless REDIS_URL names one)")
    parser.add_argument("--together", default="", help="concurrent asking: comma-separated session counts (see above)")
    parser.add_argument("--model", default="tiny-random-llava")
    parser.add_argument("--frames", type=int, default=8, help="with --together: frames each session takes first")
    parser.add_argument("--rounds", type=int, default=3, help="with --together: times each count asks, per mode")
    parser.add_argument("--answer-tokens", type=int, default=32, help="with --together: max_new_tokens of each question")
    parser.add_argument("--budget", type=int, default=2048, help="with --together or --turns: each session's budget_tokens")
    parser.add_argument("--turns", type=int, default=0, help="sessions in turn, each with recall: the worker's memory after each")
    parser.add_argument("--host-budget", type=int, default=4096, help="with --turns: each session's host_budget_tokens")
    args = parser.parse_args()
    if args.together:
        together(args)
        return
    if args.turns:
        turns(args)
        return

    folder = Path(tempfile.mkdtemp(prefix="streamvqa-load-"))
    embedded = None
    if not os.environ.get("REDIS_URL"):
        embedded = LocalCluster(folder / "cluster") if args.cluster else EmbeddedRedis(folder / "redis")
    redis_url = os.environ.get("REDIS_URL") or embedded.start()
    prefix, ports = f"svqa-load-{uuid.uuid4().hex[:8]}:", [free_port() for _ in range(args.gateways)]
    env = {
        **os.environ, "REDIS_URL": redis_url, "REDIS_PREFIX": prefix, "MODEL": "tiny-random-llava",
        "REDIS_CLUSTER": "true" if args.cluster else "false",
        "MAX_SESSIONS": str(args.sessions), "MAX_SESSIONS_PER_KEY": str(args.sessions), "SPOOL_DIR": str(folder / "spool"),
        "LOG_LEVEL": "WARNING",
        "SNAPSHOT_DIR": str(folder / "snapshots"),
    }
    processes = {f"worker{i}": children.spawn([sys.executable, "-m", "worker"], env) for i in range(args.workers)}
    for i, port in enumerate(ports):
        processes[f"gateway{i}" if args.gateways > 1 else "gateway"] = children.spawn(
            [sys.executable, "-m", "app"], {**env, "PORT": str(port)}
        )
    peaks: dict[str, int] = {}
    stop = threading.Event()
    try:
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        for base in bases:
            wait_until_serving(
                f"{base}/healthz", redis_url, prefix, list(processes.values()), 300, args.workers, cluster=args.cluster
            )
        pids = {name: p.pid for name, p in processes.items()}
        if isinstance(embedded, EmbeddedRedis):
            pids["redis"] = embedded.pid
        watcher = threading.Thread(target=_watch_rss, args=(pids, peaks, stop), daemon=True)
        watcher.start()
        results = asyncio.run(_load(bases, args))
    finally:
        stop.set()
        for process in processes.values():
            children.stop(process)
        if embedded is not None:
            embedded.stop()
    line = {
        "redis": "cluster" if args.cluster else "server",
        "gateways": args.gateways,
        "workers": args.workers,
        "sessions": args.sessions,
        "seconds": args.seconds,
        "asked": results.asked,
        "answered": results.answered,
        "failed": results.failed,
        "failures": results.failures,
        "ttft_p50_ms": _percentile(results.ttft_ms, 50),
        "ttft_p99_ms": _percentile(results.ttft_ms, 99),
        "total_p99_ms": _percentile(results.total_ms, 99),
        "lag_p99_s": _percentile(results.lag_s, 99),
        "frames": results.frames,
        "dropped": results.dropped,
        **{f"peak_rss_mib_{name}": round(rss / 2**20) for name, rss in sorted(peaks.items())},
    }
    print(json.dumps(line), flush=True)


def together(args: argparse.Namespace) -> None:
    """Concurrent asking: a batching stack beside a sequential one, on one Redis."""
    folder = Path(tempfile.mkdtemp(prefix="streamvqa-load-"))
    embedded = None if os.environ.get("REDIS_URL") else EmbeddedRedis(folder / "redis")
    redis_url = os.environ.get("REDIS_URL") or embedded.start()
    sessions = max(int(c) for c in args.together.split(","))
    processes, bases = {}, {}
    try:
        for mode, batch in (("batched", max(16, sessions)), ("sequential", 1)):
            prefix, port = f"svqa-load-{uuid.uuid4().hex[:8]}:", free_port()
            env = {
                **os.environ, "REDIS_URL": redis_url, "REDIS_PREFIX": prefix, "MODEL": args.model,
                "BATCH_SESSIONS": str(batch), "MAX_SESSIONS": str(sessions), "MAX_SESSIONS_PER_KEY": str(sessions),
                "SPOOL_DIR": str(folder / mode / "spool"), "SNAPSHOT_DIR": str(folder / mode / "snapshots"),
                "LOG_LEVEL": "WARNING", "RATE_LIMIT_PER_S": "1000", "RATE_LIMIT_BURST": "1000",
                "KV_MEMORY": os.environ.get("KV_MEMORY", TOGETHER_KV_MEMORY),  # room for every session (a CPU's default is 2 GiB)
            }
            processes[f"worker-{mode}"] = children.spawn([sys.executable, "-m", "worker"], env)
            processes[f"gateway-{mode}"] = children.spawn([sys.executable, "-m", "app"], {**env, "PORT": str(port)})
            bases[mode] = f"http://127.0.0.1:{port}"
            wait_until_serving(
                f"{bases[mode]}/healthz", redis_url, prefix,
                [processes[f"worker-{mode}"], processes[f"gateway-{mode}"]], 300, 1,
            )
        for line in asyncio.run(_together(bases, args)):
            print(json.dumps({"model": args.model, **line}), flush=True)
    finally:
        for process in processes.values():
            children.stop(process)
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()
