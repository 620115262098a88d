"""A gateway and a worker on loopback for a benchmark, on REDIS_URL or an embedded Redis."""

import contextlib
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from streamvqa import children
from streamvqa.redis_server import EmbeddedRedis, free_port
from streamvqa.run import wait_until_serving


@dataclass(frozen=True)
class Stack:
    base: str  # the gateway's URL
    redis_url: str
    prefix: str  # of every key the stack writes
    worker: subprocess.Popen
    gateway: subprocess.Popen


@contextlib.contextmanager
def serving(name: str, model: str, start_timeout_s: float = 300, **settings: str) -> Iterator[Stack]:
    """One gateway and one worker of `model` (with `settings` as further environment), keys under
    a prefix of their own and files in a fresh folder, serving until the block ends; then
    stopped, with the embedded Redis if one was started."""
    folder = Path(tempfile.mkdtemp(prefix=f"streamvqa-{name}-"))
    embedded = None if os.environ.get("REDIS_URL") else EmbeddedRedis(folder / "redis")
    redis_url = os.environ.get("REDIS_URL") or embedded.start()
    prefix, port = f"svqa-{name}-{uuid.uuid4().hex[:8]}:", free_port()
    env = {
        **os.environ, "REDIS_URL": redis_url, "REDIS_PREFIX": prefix, "PORT": str(port), "MODEL": model,
        "SPOOL_DIR": str(folder / "spool"), "SNAPSHOT_DIR": str(folder / "snapshots"), "LOG_LEVEL": "WARNING", **settings,
    }
    worker = children.spawn([sys.executable, "-m", "worker"], env)
    gateway = children.spawn([sys.executable, "-m", "app"], env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_serving(f"{base}/healthz", redis_url, prefix, [worker, gateway], start_timeout_s)
        yield Stack(base, redis_url, prefix, worker, gateway)
    finally:
        for process in (gateway, worker):
            children.stop(process)
        if embedded is not None:
            embedded.stop()
