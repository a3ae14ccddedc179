"""Per-step figures and the two gauges, recorded by the sender thread off every response's path.

Each ``pb_utils`` metric update is a synchronous round trip to tritonserver (0.03-0.25 ms on a
2-core CPU). Recorded as the steps ran, two a step (rows, wall time) woke the sender thread
between every two steps and took the engine thread's CPU and GIL while a lone request was
stepping. Here the engine thread only appends a step's figures to a queue nobody waits on; the
sender records them in one batch once the engine has no request left (right after the last
final response went out) and at least every ``every_s`` under load, then sets the gauges
(last, so a reader that sees ``dlm_requests_in_flight`` fall also finds the steps before it).
Request-level metrics (outcome, latency, tokens) are not deferred: they are recorded before
each final response, so a client that has its answer finds them.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any, NamedTuple

STEP_METRICS_EVERY_S = 1.0  # under load, buffered step figures wait at most about this long


class StepFigures(NamedTuple):
    rows: int
    seconds: float
    prefix_tokens: tuple[int, int] | None  # the prefix cache's running (lookup, hit) tokens


class StepMetrics:
    """Buffers step figures (engine thread) and records them with the gauges (sender thread)."""

    def __init__(
        self,
        metrics: Any,
        in_flight: Callable[[], int],
        queue_depth: Callable[[], int],
        every_s: float = STEP_METRICS_EVERY_S,
    ) -> None:
        self.metrics = metrics
        self.in_flight, self.queue_depth = in_flight, queue_depth
        self.every_s = every_s
        self._steps: queue.SimpleQueue[StepFigures] = queue.SimpleQueue()
        self._recorded_at = time.monotonic()
        self._gauges: dict[str, int] = {}  # the values last set

    def add(self, figures: StepFigures) -> None:
        """Engine thread: keep a step's figures (no round trip, no wake-up)."""
        self._steps.put(figures)

    def record(self, idle: bool) -> None:
        """Sender thread, between responses: the buffered steps when the engine is idle or
        they are ``every_s`` old, then the gauges that changed."""
        now = time.monotonic()
        if idle or now - self._recorded_at >= self.every_s:
            self._recorded_at = now
            self._record_steps()
        self._set_gauge("in_flight", self.in_flight())
        self._set_gauge("queue_depth", self.queue_depth())

    def _record_steps(self) -> None:
        prefix_tokens = None
        while True:
            try:
                step = self._steps.get_nowait()
            except queue.Empty:
                break
            self.metrics.rows_per_step.observe(step.rows)
            self.metrics.step_seconds.observe(step.seconds)
            prefix_tokens = step.prefix_tokens or prefix_tokens
        if prefix_tokens is not None:  # running totals: the latest says all
            self.metrics.prefix_cache(*prefix_tokens)

    def _set_gauge(self, name: str, value: int) -> None:
        if self._gauges.get(name) != value:
            self._gauges[name] = value
            getattr(self.metrics, name).set(value)
