"""Child processes Phoenix starts (its local teacher, vLLM, the benchmarks' servers): a free
loopback port, a child that dies with its parent, and a stop that never leaves one behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec (Linux): no orphans on kill -9
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


PREEXEC = _die_with_parent if sys.platform == "linux" else None  # Popen(preexec_fn=PREEXEC)


def stop_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """For a child started with `start_new_session=True` (vLLM starts engine processes):
    SIGTERM to its whole process group, then SIGKILL to whatever of the group is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc.returncode


def stop(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; returns its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
