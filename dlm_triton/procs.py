"""Process and /proc helpers for the launcher (no psutil: a few /proc reads suffice)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A port free right now (tests run in parallel: never hard-code 8000)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free right now. All sockets stay bound until every port is picked:
    closed one by one, the kernel may hand the same port out twice (tritonserver then refused
    HTTP and gRPC on one port in a suite run)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def has_gpu() -> bool:
    """Cheap GPU check without importing torch (that takes seconds)."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def proc_children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc; no psutil dependency)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def http_text(url: str, timeout: float = 2.0) -> str:
    """The body of a GET, or "" when it fails (for best-effort reads such as metrics)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return ""


def suppress() -> contextlib.suppress:
    """Ignore a process or file that vanished in between."""
    return contextlib.suppress(ProcessLookupError, FileNotFoundError, PermissionError)


def term_with_parent() -> None:
    """In the child: SIGTERM when the launcher dies (even by SIGKILL), so tritonserver is not
    orphaned. Linux ties this to the *thread* that started it: only for launchers that start
    the server from their main thread (``dlm-triton serve``)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def terminate(proc: subprocess.Popen, timeout: float) -> bool:
    """SIGTERM, bounded wait, SIGKILL; True if it had to be killed."""
    if proc.poll() is not None:
        return False
    with suppress():
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
        return False
    except subprocess.TimeoutExpired:
        with suppress():
            proc.kill()
        proc.wait(timeout=10)
        return True
