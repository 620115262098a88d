"""`python -m streamvqa.run` (what `make run` starts): Redis when needed, one gateway, one worker.

Ctrl-C (or SIGTERM) stops the gateway, then the worker, then the embedded Redis.
"""

import logging
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import Popen

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from streamvqa import children
from streamvqa.protocol import Keys, WorkerInfo
from streamvqa.redis_client import connect_sync
from streamvqa.redis_server import EmbeddedRedis
from streamvqa.settings import DEFAULT_MODEL

log = logging.getLogger("streamvqa.run")


class LauncherSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore")

    redis_url: str = Field("", description="Use this Redis; empty starts an embedded one.")
    redis_cluster: bool = Field(False, description="REDIS_URL names a node of a Redis Cluster.")
    redis_prefix: str = "svqa:"
    host: str = "127.0.0.1"
    port: int = 8000
    run_dir: Path = Field(Path("run"), description="Embedded Redis files and the upload spool.")
    startup_timeout_s: float = Field(1800, description="How long to wait for the worker's model to load.")
    model: str = DEFAULT_MODEL


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _local_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def wait_until_serving(
    health_url: str,
    redis_url: str,
    prefix: str,
    processes: Sequence[Popen],
    timeout_s: float,
    workers: int = 1,
    report: Callable[[str], None] | None = None,
    cluster: bool = False,
) -> None:
    """Until the gateway's /healthz answers 200 and `workers` live workers are registered; `report`
    hears "gateway" and "workers" once each, as each part is up.

    Raises RuntimeError when one of `processes` exits first or after `timeout_s`.
    """
    client = connect_sync(redis_url, cluster)
    deadline = time.monotonic() + timeout_s
    up: set[str] = set()
    try:
        while time.monotonic() < deadline:
            if any(process.poll() is not None for process in processes):
                raise RuntimeError("a process exited during start-up; its reason is above")
            infos = [WorkerInfo.model_validate_json(raw) for raw in client.hvals(Keys(prefix).workers())]
            parts = {"workers": sum(info.alive for info in infos) >= workers, "gateway": _answers(health_url)}
            for part in sorted(name for name, ready in parts.items() if ready and name not in up):
                up.add(part)
                if report:
                    report(part)
            if len(up) == len(parts):
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError(f"not serving after {timeout_s} s")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = LauncherSettings()
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started from a script that ignores it (`cmd &`)
    embedded = None
    processes: list[Popen] = []
    try:
        redis_url = settings.redis_url
        if settings.redis_cluster and not redis_url:
            raise RuntimeError("REDIS_CLUSTER=true needs REDIS_URL: a node of the cluster")
        if not redis_url:
            log.info("starting Redis…")
            embedded = EmbeddedRedis(settings.run_dir.resolve() / "redis")
            redis_url = embedded.start()
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "SPOOL_DIR": os.environ.get("SPOOL_DIR", str(settings.run_dir.resolve() / "spool")),
        }
        log.info("starting the gateway, and a worker: loading %s…", settings.model)
        processes = [children.spawn([sys.executable, "-m", module], env) for module in ("worker", "app")]
        health_url = f"http://{_local_host(settings.host)}:{settings.port}/healthz"
        stages = {"gateway": "the gateway is up", "workers": f"the worker serves {settings.model}"}
        wait_until_serving(
            health_url, redis_url, settings.redis_prefix, processes, settings.startup_timeout_s,
            report=lambda part: log.info("%s", stages[part]), cluster=settings.redis_cluster,
        )
        where = f"embedded, files in {embedded.directory}" if embedded else (
            "a cluster, from REDIS_URL" if settings.redis_cluster else "from REDIS_URL"
        )
        log.info(
            "\nstreamvqa is running\n  dashboard: http://%s:%d/\n  redis:     %s (%s)\nPress Ctrl-C to stop.\n",
            _local_host(settings.host), settings.port, redis_url, where,
        )
        while all(process.poll() is None for process in processes):
            time.sleep(0.5)
        log.error("a process exited; stopping the others")
        return 1
    except KeyboardInterrupt:
        log.info("stopping")
        return 0
    except RuntimeError as err:
        log.error("%s", err)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for process in reversed(processes):  # gateway first: no new work reaches the worker
            children.stop(process)
        if embedded:
            embedded.stop()


if __name__ == "__main__":
    sys.exit(main())
