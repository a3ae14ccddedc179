"""How busy each instance of one model is, shared between the instances' stub processes, so
that new requests go to the least busy one.

Triton hands a request to whichever instance of a model is free to take one. A decoupled
model's ``execute()`` returns at once, so every instance always looks free and requests are
spread evenly by count, not by load: one engine can hold ten long requests while its sibling on
the next GPU idles. The fix needs no scheduler of our own: an instance whose outstanding work
exceeds a sibling's stays inside ``execute()`` (after queueing what it was given) until that is
no longer so, and Triton gives the next requests to the instances that are free. The least busy
instance never waits, so some instance always takes work.

Each instance publishes one number (its outstanding work: the token-forwards its open requests
were estimated to need, so one long answer outweighs many short ones) in a small file under
``/dev/shm/dlm_load_<tritonserver pid>_<model>/<stub pid>``; siblings read the others' files.
A file whose stub is gone is skipped and removed; the instance removes its own at shutdown and
the launcher removes the directory of a server it stopped (``remove_boards``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path("/dev/shm")
PREFIX = "dlm_load_"
_VALUE = struct.Struct("<q")
# How often a waiting instance re-reads its siblings' load, and the longest it waits: a sibling
# that stops taking requests (wedged, not dead) must not hold this instance's intake forever.
# Shorter caps leak: every expiry hands the busy instance one more request.
POLL_S = 0.002
MAX_WAIT_S = 30.0


def board_dir(model: str, server_pid: int, root: Path = ROOT) -> Path:
    """The directory that the instances of `model` in the tritonserver `server_pid` share."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)
    return root / f"{PREFIX}{server_pid}_{safe}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class LoadBoard:
    """One instance's view of the board: publish its own load, read its siblings'."""

    def __init__(self, directory: Path, pid: int | None = None) -> None:
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = directory / str(self.pid)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.publish(0)

    def publish(self, load: int) -> None:
        os.pwrite(self._fd, _VALUE.pack(load), 0)

    def siblings(self) -> dict[int, int]:
        """The other live instances' published loads, by stub pid."""
        loads: dict[int, int] = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return loads
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            pid = int(entry.name)
            if not _alive(pid):  # a killed stub cannot remove its own file
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            try:
                with open(entry.path, "rb") as f:
                    raw = f.read(_VALUE.size)
            except OSError:
                continue
            if len(raw) == _VALUE.size:
                loads[pid] = _VALUE.unpack(raw)[0]
        return loads

    def busier_than_a_sibling(self, load: int) -> bool:
        """True while another instance has strictly less outstanding work than `load`."""
        others = self.siblings()
        return bool(others) and load > min(others.values())

    def wait_turn(
        self,
        load: Callable[[], int],
        stop: Callable[[], bool],
        max_wait_s: float = MAX_WAIT_S,
    ) -> float:
        """Block while this instance is busier than a sibling (re-publishing its load as it
        changes), at most `max_wait_s` or until `stop()`; returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            current = load()
            self.publish(current)
            if stop() or not self.busier_than_a_sibling(current):
                return time.monotonic() - t0
            if time.monotonic() - t0 >= max_wait_s:
                return time.monotonic() - t0
            time.sleep(POLL_S)

    def close(self) -> None:
        """Remove this instance's file, and the directory once no instance is left."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # fails while a sibling's file is there: that is fine


def remove_boards(server_pid: int, root: Path = ROOT) -> list[Path]:
    """Remove every board directory of the tritonserver `server_pid` (after it stopped)."""
    removed = []
    for path in root.glob(f"{PREFIX}{server_pid}_*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
