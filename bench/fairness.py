"""One worker, one session with a long queue of long answers: how long another session's
question waits, how fast DELETE stops the long answer, how fast SIGTERM stops the worker.

    python -m bench.fairness [--questions 16] [--tokens 1024] [--probes 20]

Starts Redis (REDIS_URL, else an embedded server), one gateway and one worker serving
`tiny-random-llava` on loopback; each session shows one frame first (a question needs video).
First `--probes` two-token questions on an idle session, one after another (`idle_*`); then a
second session queues `--questions` questions of `--tokens` tokens each, and while its first
answer streams the same probes run again (`busy_*`: time from `POST /ask` to its reply, the
whole answer). The worker runs one engine step at a time (the questions that can start, a
token of each answer under way, frames within the step's token budget): the probes wait for the
step under way, never for the long answers. Then DELETE of the busy session (`delete_stop_s`:
until its answer stream stops growing and the worker lists it no more), and SIGTERM of the worker
while it answers (`sigterm_exit_s`). One JSON line.
"""

import argparse
import json
import signal
import time

import httpx
import numpy as np
import redis
from websockets.sync.client import connect

from bench.common import frame_jpeg
from bench.stack import serving
from streamvqa.protocol import WorkerInfo, frame_message


class User:
    def __init__(self, base: str) -> None:
        self.http = httpx.Client(base_url=base, timeout=600)
        created = self.http.post("/sessions", json={}).json()
        self.id = created["id"]
        self.http.headers["Authorization"] = f"Bearer {created['token']}"
        self._show_a_frame(base.replace("http://", "ws://"), created["token"])

    def _show_a_frame(self, base: str, token: str) -> None:
        """One frame into the cache over the stream socket: a question needs video to be about."""
        with connect(f"{base}/sessions/{self.id}/stream?token={token}", max_size=None) as socket:
            socket.send(json.dumps({"type": "start", "format": "frames"}))
            socket.send(frame_message(0.0, frame_jpeg(0)))
            socket.send(json.dumps({"type": "end"}))
            for message in socket:
                if json.loads(message).get("state") == "ingested":
                    break

    def ask(self, question: str, tokens: int, **body: object) -> httpx.Response:
        return self.http.post(f"/sessions/{self.id}/ask", json={"question": question, "max_new_tokens": tokens, **body})

    def status(self, answer_id: str) -> dict:
        return self.http.get(f"/sessions/{self.id}/answers/{answer_id}").json()


def _probes(user: User, count: int) -> list[float]:
    seconds = []
    for i in range(count):
        started = time.perf_counter()
        reply = user.ask(f"probe {i}", 2)
        assert reply.status_code == 200, reply.text
        seconds.append(time.perf_counter() - started)
    return seconds


def _summary(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1000
    return {f"{name}_p50_ms": round(float(np.percentile(ms, 50)), 1), f"{name}_p99_ms": round(float(np.percentile(ms, 99)), 1),
            f"{name}_max_ms": round(float(ms.max()), 1)}


def _queue(user: User, questions: int, tokens: int) -> list[str]:
    """Queue the long questions; return once the first answer streams."""
    ids = [user.ask(f"long {i}", tokens, wait_s=0).json()["answer_id"] for i in range(questions)]
    while user.status(ids[0])["status"] != "streaming":
        time.sleep(0.02)
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()

    line: dict[str, object] = {"questions": args.questions, "tokens": args.tokens, "probes": args.probes}
    with serving("fair", "tiny-random-llava") as stack:
        base, prefix, worker = stack.base, stack.prefix, stack.worker
        store = redis.Redis.from_url(stack.redis_url)
        probe = User(base)
        line |= _summary("idle", _probes(probe, args.probes))

        busy = User(base)
        ids = _queue(busy, args.questions, args.tokens)
        first_tokens = busy.status(ids[0])["tokens"]
        started = time.perf_counter()
        line |= _summary("busy", _probes(probe, args.probes))
        line["busy_tokens_per_s"] = round((busy.status(ids[0])["tokens"] - first_tokens) / (time.perf_counter() - started), 1)
        line["busy_answers_done_meanwhile"] = sum(busy.status(i)["status"] == "done" for i in ids)
        line["busy_over_idle_p99"] = round(line["busy_p99_ms"] / line["idle_p99_ms"], 2)

        answer = f"{prefix}session:{{{busy.id}}}:answer:{ids[0]}"
        deleted_at = time.perf_counter()
        busy.http.delete(f"/sessions/{busy.id}")
        while any(busy.id in WorkerInfo.model_validate_json(w).session_ids for w in store.hvals(f"{prefix}workers")):
            time.sleep(0.005)
        line["delete_stop_s"] = round(time.perf_counter() - deleted_at, 3)
        time.sleep(1)
        line["keys_after_delete"] = len(store.keys(f"{prefix}session:{{{busy.id}}}*")) + store.exists(answer)

        last = User(base)
        _queue(last, 2, args.tokens)
        stopped_at = time.perf_counter()
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=120)
        line["sigterm_exit_s"] = round(time.perf_counter() - stopped_at, 2)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
