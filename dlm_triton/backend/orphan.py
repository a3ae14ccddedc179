"""The stub's tie to tritonserver: tritonserver starts the Python stub and cannot make it die
with it, so a stub whose tritonserver died (SIGKILL, crash) ends itself."""

from __future__ import annotations

import os
import threading


def exit_when_orphaned(interval_s: float = 0.5) -> threading.Thread:
    """In a process whose parent cannot set its death signal (a Triton Python stub, started
    by tritonserver): a daemon thread that ends this process at once (``os._exit``: no
    interpreter shutdown that could wait on a busy thread) when the parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(interval_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="dlm-orphan-watch", daemon=True)
    thread.start()
    return thread
