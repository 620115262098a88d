"""Child processes that live and die with their parent, in their own process group.

Their own group keeps a terminal's Ctrl-C (sent to the whole foreground group) from reaching
them before the parent decides the order of shutdown.
"""

import ctypes
import os
import signal
import subprocess
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: new session; SIGTERM when the parent dies, however it dies (Linux)."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own shutdown path still stops the child


def spawn(args: Sequence[str], env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
    return subprocess.Popen(list(args), env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, **popen)


def stop(process: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; waits for the exit."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
