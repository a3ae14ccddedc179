"""Process and /proc helpers for the launcher (no psutil: a few /proc reads suffice)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


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


def visible_gpus() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [x.strip() for x in listed.split(",") if x.strip()]
        return len(ids[: ids.index("-1")] if "-1" in ids else ids)  # -1 hides what follows
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


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


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when the thread that started it ends (the
    process dying by any signal, SIGKILL too, ends it), so a killed test run, benchmark or
    launcher leaves no server or proxy behind. Linux ties this to the *thread*: start children
    through :func:`spawn`, whose thread lives as long as the process."""
    parent = os.getpid()

    def preexec() -> None:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)

    return preexec


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(cmd: Sequence[str], *, die_signal: int = signal.SIGTERM, **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen`` of a child that dies with this process (:func:`die_with_parent`).

    Started from the main thread, or else from one spawner thread that lives until the
    process exits: a child started from a short-lived thread (the supervisor's restart) would
    otherwise get its signal when that thread ends."""
    kw["preexec_fn"] = die_with_parent(die_signal)
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(cmd, **kw)
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlm-spawner")
    return _spawner.submit(subprocess.Popen, cmd, **kw).result()


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
