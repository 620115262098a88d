"""What `make run` starts: embedded Redis, gateway and worker, a printed address, a clean Ctrl-C."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from streamvqa.redis_server import free_port
from tests.support import Client, sample_video

READY_TIMEOUT_S = 120


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def test_run_serves_the_dashboard_and_the_whole_path_then_stops_cleanly(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the embedded Redis
    env |= {"PORT": str(port), "RUN_DIR": str(tmp_path / "run"), "TORCH_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "streamvqa.run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not any("dashboard:" in line for line in lines):
            assert launcher.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        output = "".join(lines)
        assert f"dashboard: http://127.0.0.1:{port}/" in output
        redis_port = int(re.search(r"redis:\s+redis://127\.0\.0\.1:(\d+)/0 \(embedded", output).group(1))
        assert (tmp_path / "run" / "redis" / "redis.log").is_file()

        user = Client(f"http://127.0.0.1:{port}")
        assert "<title>streamvqa</title>" in user.http.get("/").text
        assert user.create(fps=1).status_code == 201
        assert user.upload(sample_video("bikes.mp4").read_bytes()).status_code == 202
        session = user.wait_for_state("ingested", "error")
        assert (session["state"], session["frames_ingested"]) == ("ingested", 10)
        assert session["cache_tokens"] > 0
        assert user.ask("What moves?", max_new_tokens=8).status_code == 200
        user.http.close()
    finally:
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C sends
        code = launcher.wait(timeout=60)
    assert code == 0, "".join(lines)
    assert not _accepts(port)
    assert not _accepts(redis_port)
