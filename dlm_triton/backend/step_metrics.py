"""Per-step figures and the two gauges, recorded by the sender thread off every response's path.

Each ``pb_utils`` metric update is a synchronous round trip to tritonserver. Recorded as the
steps run, two a step (rows, wall time) would wake the sender thread between every two steps
and take the engine thread's CPU and GIL while a lone request is stepping. Here the engine thread only appends a step's figures to a queue nobody waits on; the
sender records them all once the engine has no request left (right after the last final
response went out) and, under load, a few at a time between responses once they are
``every_s`` old, then sets the gauges (last, so a reader that sees ``dlm_requests_in_flight``
fall also finds the steps before it). A request's own metrics follow its final response
(``TritonPythonModel._record_request``).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any, NamedTuple

STEP_METRICS_EVERY_S = 1.0  # under load, buffered step figures wait at most about this long
# under load, steps recorded between two responses (two round trips each): a second of a GPU's
# small steps is a hundred or so, whose round trips in one go would hold a streamed chunk back
STEPS_PER_RECORD = 8
CATCH_UP_S = 0.005  # while catching up, the sender records again after this without a response


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
        steps_per_record: int = STEPS_PER_RECORD,
        fused_fallbacks: Callable[[], int] | None = None,
        graph_captures: Callable[[], int] | None = None,
    ) -> None:
        self.metrics = metrics
        self.in_flight, self.queue_depth = in_flight, queue_depth
        self.fused_fallbacks = fused_fallbacks
        self.graph_captures = graph_captures
        self._totals: dict[str, int] = {}  # counters' running totals, as last recorded
        self.every_s = every_s
        self.steps_per_record = steps_per_record
        self._catching_up = False  # due, and more were buffered than one record takes
        self._steps: queue.SimpleQueue[StepFigures] = queue.SimpleQueue()
        self._recorded_at = time.monotonic()
        self._gauges: dict[str, int] = {}  # the values last set

    @property
    def catching_up(self) -> bool:
        """Due steps are left: the sender should come back soon, not in ``every_s``."""
        return self._catching_up

    def add(self, figures: StepFigures) -> None:
        """Engine thread: keep a step's figures (no round trip, no wake-up)."""
        self._steps.put(figures)

    def record(self, idle: bool) -> None:
        """Sender thread, between responses: all buffered steps when the engine is idle; under
        load, once they are ``every_s`` old, ``steps_per_record`` per call until caught up;
        then the gauges that changed."""
        now = time.monotonic()
        if idle or self._catching_up or now - self._recorded_at >= self.every_s:
            self._recorded_at = now
            self._catching_up = self._record_steps(None if idle else self.steps_per_record)
        self._set_gauge("in_flight", self.in_flight())
        self._set_gauge("queue_depth", self.queue_depth())
        if self.fused_fallbacks is not None:
            self._set_gauge("fused_fallbacks", self.fused_fallbacks())
        if self.graph_captures is not None:
            self._advance_counter("graph_captures", self.graph_captures())

    def _record_steps(self, limit: int | None) -> bool:
        """Record up to ``limit`` buffered steps (all if None); True if some are left."""
        prefix_tokens = None
        recorded = 0
        while limit is None or recorded < limit:
            try:
                step = self._steps.get_nowait()
            except queue.Empty:
                break
            self.metrics.rows_per_step.observe(step.rows)
            self.metrics.step_seconds.observe(step.seconds)
            prefix_tokens = step.prefix_tokens or prefix_tokens
            recorded += 1
        if prefix_tokens is not None:  # running totals: the latest says all
            self.metrics.prefix_cache(*prefix_tokens)
        return limit is not None and recorded == limit and not self._steps.empty()

    def _advance_counter(self, name: str, total: int) -> None:
        """A counter kept at a running total the engine counts (it never goes back)."""
        grown = total - self._totals.get(name, 0)
        if grown > 0:
            self._totals[name] = total
            getattr(self.metrics, name).increment(grown)

    def _set_gauge(self, name: str, value: int) -> None:
        if self._gauges.get(name) != value:
            self._gauges[name] = value
            getattr(self.metrics, name).set(value)
