"""What `make run` starts: embedded Redis, gateway and worker, a printed address, a clean Ctrl-C;
a second start that reads the converted weights, says what it waits for, and keeps polling (and
the libraries' own output: progress bars, FFmpeg's lines for a damaged video) quiet."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamvqa.redis_server import free_port
from tests.support import Client, running_stack, sample_video

READY_TIMEOUT_S = 120


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


class Launcher:
    """`python -m streamvqa.run` with its output (stdout and stderr) gathered line by line."""

    def __init__(self, run_dir: Path, model_cache: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the embedded Redis
        env |= {"PORT": str(self.port), "RUN_DIR": str(run_dir), "TORCH_THREADS": "1", "MODEL_CACHE_DIR": str(model_cache)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "streamvqa.run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.process.stdout.readline, "")), daemon=True).start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output:
            assert self.process.poll() is None, self.output
            assert time.monotonic() < deadline, self.output
            time.sleep(0.1)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGINT)  # what Ctrl-C sends
        return self.process.wait(timeout=60)


def test_run_serves_the_dashboard_and_the_whole_path_then_stops_cleanly(tmp_path, model_cache):
    launcher = Launcher(tmp_path / "run", model_cache)
    try:
        launcher.wait_for("dashboard:")
        output = launcher.output
        assert f"dashboard: http://127.0.0.1:{launcher.port}/" in output
        redis_port = int(re.search(r"redis:\s+redis://127\.0\.0\.1:(\d+)/0 \(embedded", output).group(1))
        assert (tmp_path / "run" / "redis" / "redis.log").is_file()

        user = Client(f"http://127.0.0.1:{launcher.port}")
        assert "<title>streamvqa</title>" in user.http.get("/").text
        assert user.create(fps=1).status_code == 201
        assert user.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
        session = user.wait_for_state("ingested", "error")
        assert (session["state"], session["frames_ingested"]) == ("ingested", 10)
        assert session["cache_tokens"] > 0
        assert user.ask("What moves?", max_new_tokens=8).status_code == 200
        user.http.close()
    finally:
        code = launcher.stop()
    assert code == 0, launcher.output
    assert not _accepts(launcher.port)
    assert not _accepts(redis_port)


def test_a_second_start_reads_the_converted_weights_says_what_it_waits_for_and_keeps_polling_out_of_the_log(tmp_path, model_cache):
    first = Launcher(tmp_path / "run", model_cache)  # converts SmolLM2's weights unless the test above did
    first.wait_for("streamvqa is running")
    assert first.stop() == 0, first.output

    second = Launcher(tmp_path / "run", model_cache)
    try:
        second.wait_for("streamvqa is running")
        user = Client(f"http://127.0.0.1:{second.port}")
        assert user.create(fps=1).status_code == 201
        for _ in range(3):  # what the dashboard does every second
            assert user.get().status_code == 200
            assert user.http.get(f"/sessions/{user.id}/memory", headers=user.auth).status_code == 200
        assert user.http.get(f"/sessions/{'0' * 32}", headers=user.auth).status_code == 404
        second.wait_for(" 404")
        damaged = Client(f"http://127.0.0.1:{second.port}")
        assert damaged.create(fps=1).status_code == 201
        assert damaged.upload(_damaged(sample_video("bikes.mp4").read_bytes())).status_code == 202
        assert damaged.wait_for_state("ingested", "error")["state"] == "error"  # what the user is told
        second.wait_for(f"session {damaged.id} failed")
        user.http.close()
    finally:
        assert second.stop() == 0, second.output
    output = second.output
    lines = [line.strip() for line in second.lines]
    order = ["starting Redis…", "starting the gateway, and a worker: loading streamvqa-demo…",
             "the worker serves streamvqa-demo", "streamvqa is running"]
    assert [lines.index(line) for line in order] == sorted(lines.index(line) for line in order), output
    assert "Converting and de-quantizing" not in output  # read back, not converted again
    assert re.search(r"INFO worker: streamvqa-demo loaded in \d+\.\d s", output)
    assert "Uvicorn running on" not in output
    assert f"gateway listening on http://127.0.0.1:{second.port} (questions are answered once a worker serves" in output
    assert '"POST /sessions HTTP/1.1" 201' in output
    assert f'"GET /sessions/{"0" * 32} HTTP/1.1" 404' in output  # failures are still logged
    assert f"GET /sessions/{user.id} " not in output and "/memory" not in output and "/healthz" not in output
    assert "Loading weights" not in output  # transformers' progress bar
    assert "[h264 @" not in output and "error while decoding" not in output  # FFmpeg's (PyAV's and decord's)


def _damaged(video: bytes) -> bytes:
    """`video` with 200 runs of 16 bytes in its middle half overwritten: frames whose blocks FFmpeg
    cannot decode, each of which it reports."""
    data, rng = bytearray(video), random.Random(1)
    for _ in range(200):
        at = rng.randrange(len(data) // 4, len(data) * 3 // 4)
        data[at : at + 16] = bytes(rng.randrange(256) for _ in range(16))
    return bytes(data)


def test_access_log_polling_logs_the_polling_routes_too(redis_url, tmp_path):
    with running_stack(redis_url, tmp_path, ACCESS_LOG_POLLING="true") as stack:
        user = Client(stack.url)
        assert user.create(fps=1).status_code == 201
        assert user.get().status_code == 200
        deadline = time.monotonic() + 10
        while f'"GET /sessions/{user.id} HTTP/1.1" 200' not in stack.log("gateway"):
            assert time.monotonic() < deadline, stack.log("gateway")
            time.sleep(0.1)
        assert '"GET /healthz HTTP/1.1" 200' in stack.log("gateway")  # the stack's own wait for it
        user.http.close()
