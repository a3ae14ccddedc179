"""Step figures are recorded off the responses' path: all when idle, a few at a time when due."""

from __future__ import annotations

from dlm_triton.backend.step_metrics import StepFigures, StepMetrics


class _Series:
    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)

    def set(self, value: float) -> None:
        self.values.append(value)

    def increment(self, value: float) -> None:
        self.values.append(value)


class _Metrics:
    def __init__(self) -> None:
        self.rows_per_step, self.step_seconds = _Series(), _Series()
        self.in_flight, self.queue_depth = _Series(), _Series()
        self.prefix: list[tuple[int, int]] = []

    def prefix_cache(self, lookup: int, hit: int) -> None:
        self.prefix.append((lookup, hit))


def _recorder(every_s: float, gauges: dict[str, int]) -> tuple[StepMetrics, _Metrics]:
    metrics = _Metrics()
    recorder = StepMetrics(
        metrics,
        in_flight=lambda: gauges["in_flight"],
        queue_depth=lambda: gauges["queue_depth"],
        every_s=every_s,
        steps_per_record=8,
    )
    return recorder, metrics


def test_nothing_is_recorded_under_load_before_it_is_due_and_all_once_idle() -> None:
    gauges = {"in_flight": 2, "queue_depth": 0}
    recorder, metrics = _recorder(3600, gauges)
    for i in range(20):
        recorder.add(StepFigures(rows=i % 3 + 1, seconds=0.01 * i, prefix_tokens=(i, i // 2)))
    recorder.record(idle=False)
    assert metrics.rows_per_step.values == []
    assert metrics.in_flight.values == [2] and metrics.queue_depth.values == [0]
    gauges["in_flight"] = 0
    recorder.record(idle=True)
    assert metrics.rows_per_step.values == [i % 3 + 1 for i in range(20)]
    assert metrics.step_seconds.values == [0.01 * i for i in range(20)]
    assert metrics.prefix == [(19, 9)]  # running totals: only the latest
    assert metrics.in_flight.values == [2, 0]  # set again only when it changed
    recorder.record(idle=True)
    assert len(metrics.rows_per_step.values) == 20 and metrics.in_flight.values == [2, 0]


def test_due_steps_are_recorded_a_few_at_a_time_until_caught_up() -> None:
    recorder, metrics = _recorder(0, {"in_flight": 1, "queue_depth": 0})
    for _ in range(20):
        recorder.add(StepFigures(rows=1, seconds=0.01, prefix_tokens=None))
    recorded = []
    for _ in range(3):
        recorder.record(idle=False)
        recorded.append(len(metrics.rows_per_step.values))
        if not recorder.catching_up:
            break
    assert recorded == [8, 16, 20]
    assert not recorder.catching_up and metrics.prefix == []


def test_idle_records_the_rest_and_ends_catching_up() -> None:
    recorder, metrics = _recorder(0, {"in_flight": 0, "queue_depth": 0})
    for _ in range(20):
        recorder.add(StepFigures(rows=2, seconds=0.01, prefix_tokens=None))
    recorder.record(idle=False)
    assert recorder.catching_up and len(metrics.rows_per_step.values) == 8
    recorder.record(idle=True)
    assert not recorder.catching_up and len(metrics.rows_per_step.values) == 20


def test_fused_kernel_fallbacks_reach_their_gauge_when_they_change() -> None:
    metrics = _Metrics()
    metrics.fused_fallbacks = _Series()
    fallbacks: list[str] = []
    recorder = StepMetrics(
        metrics, in_flight=lambda: 0, queue_depth=lambda: 0, fused_fallbacks=lambda: len(fallbacks)
    )
    recorder.record(idle=True)
    fallbacks.append("_rms_norm")  # a compiled kernel fell back to eager
    recorder.record(idle=True)
    recorder.record(idle=True)
    assert metrics.fused_fallbacks.values == [0, 1]


def test_graph_captures_advance_their_counter_by_what_is_new() -> None:
    """The engine counts captures as a running total; the counter gets only the growth."""
    metrics = _Metrics()
    metrics.graph_captures = _Series()
    total = [0]
    recorder = StepMetrics(
        metrics, in_flight=lambda: 0, queue_depth=lambda: 0, graph_captures=lambda: total[0]
    )
    recorder.record(idle=True)  # none yet: nothing to add
    total[0] = 5
    recorder.record(idle=True)
    recorder.record(idle=True)  # unchanged: nothing added
    total[0] = 7
    recorder.record(idle=True)
    assert metrics.graph_captures.values == [5, 2]
