"""Drain before the listener closes: new calls get 503 ``draining`` while running ones finish.

uvicorn closes its listening socket as soon as SIGTERM arrives, so a client arriving during
the drain would get "connection refused" and the app's own 503 ``draining`` answer would never
be seen. :class:`DrainingServer` marks the app as draining first, keeps serving (503 for new
calls, running streams continue) until no request is in flight or the drain timeout passes,
and only then lets uvicorn shut down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal starts a drain instead of closing at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        begin_drain: Callable[[], None],
        in_flight: Callable[[], int],
        drain_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self._begin_drain = begin_drain
        self._in_flight = in_flight
        self._drain_timeout_s = drain_timeout_s
        self._draining: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self._begin_drain()
        self._draining = threading.Thread(
            target=self._drain_then_exit, args=(sig, frame), name="proxy-drain", daemon=True
        )
        self._draining.start()

    def _drain_then_exit(self, sig: int, frame: Any) -> None:
        deadline = time.monotonic() + self._drain_timeout_s
        while self._in_flight() > 0 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        super().handle_exit(sig, frame)
