"""Notice a dead model and bring it back: the launcher's watchdog thread.

Triton 2.51 does not notice a Python stub killed under it: the stub's requests hang until the
client gives up, readiness stays green, and later requests get 500 "Stub process is not
healthy". So the launcher watches the stubs it started (and tritonserver itself) by PID; on a
death it restarts the server (:meth:`TritonServerProcess.restart`): in-flight requests end at
once with a connection error (the proxy answers them with an SSE error event or 503), health is
non-ready while the model loads, and the restart is counted in ``dlm_model_restarts_total``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Protocol

CHECK_INTERVAL_S = 0.5
BACKOFF_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # between consecutive failed restarts


class Supervised(Protocol):
    restarts: int

    def dead_reason(self) -> str | None: ...

    def restart(self, reason: str) -> None: ...


class Supervisor:
    """Polls ``dead_reason()`` and calls ``restart()``; a failed restart is retried with
    back-off until one succeeds or :meth:`stop` is called."""

    def __init__(self, target: Supervised, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.target = target
        self.interval_s = interval_s
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlm-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                reason = self.target.dead_reason()
            except Exception as exc:  # never let the watchdog die
                reason = None
                print(f"supervisor: check failed: {exc}", file=sys.stderr)
            if reason is None:
                continue
            delay = BACKOFF_S[min(self.failures, len(BACKOFF_S) - 1)]
            if delay and self._stop.wait(delay):
                return
            print(f"supervisor: {reason}; restarting tritonserver", file=sys.stderr)
            t0 = time.monotonic()
            try:
                self.target.restart(reason)
            except Exception as exc:
                self.failures += 1
                print(f"supervisor: restart failed: {exc}", file=sys.stderr)
                continue
            self.failures = 0
            print(
                f"supervisor: model back after {time.monotonic() - t0:.1f}s "
                f"(restart {self.target.restarts})",
                file=sys.stderr,
            )
