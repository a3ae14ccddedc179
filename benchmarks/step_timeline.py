"""Where a run's steps spend their time: host time per step and the device-busy fraction.

A denoising step is fast only while the GPU never waits for the host. One profiled run
(`torch.profiler`, Kineto's raw activity list) gives both sides:

- `device_busy`: the union of the GPU's kernel, copy and memset intervals over the run's wall
  time (1.0: the GPU never idled; overlapping kernels count once);
- `host_ms_per_step`: the run's wall time less the time the host sat blocked in a device
  synchronisation (stream, event or device synchronise, a copy that waits), per step: the
  time the host itself needs a step. Above the step's GPU time, the host sets the pace.

Profiling adds host time of its own (each op is recorded), so these figures are beside the
timed run, not the timed run itself: the benchmarks time a run without the profiler and then
profile one more.

    with StepTimeline() as timeline:
        engine.generate(prompts, params)
    timeline.report(steps)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# device work: what the GPU's engines ran
DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
# host calls that block until the device catches up (the runtime's and the driver's names)
BLOCKING_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
)

Interval = tuple[int, int]  # (start ns, end ns)
WINDOW = "step_timeline_window"


def union_ns(intervals: list[Interval]) -> int:
    """Total length of the union of intervals (overlaps counted once)."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    """The parts of intervals inside `window`."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


@dataclass
class Timeline:
    """A run's window and its device and blocked-host intervals (ns)."""

    window: Interval
    device: list[Interval]
    blocked: list[Interval]
    has_device: bool

    def report(self, steps: int) -> dict[str, float | None]:
        wall = self.window[1] - self.window[0]
        blocked = union_ns(clip(self.blocked, self.window))
        busy = union_ns(clip(self.device, self.window))
        return {
            "wall_ms": wall / 1e6,
            "blocked_ms": blocked / 1e6,
            "host_ms_per_step": (wall - blocked) / 1e6 / max(1, steps),
            "device_busy": busy / wall if self.has_device and wall > 0 else None,
        }


def on_device(event: Any) -> bool:
    """Whether a Kineto event is work the GPU ran: by its activity type where the event has
    one (newer PyTorch), else by its device (a kernel, copy or memset is a CUDA event; the
    host's runtime calls are CPU events)."""
    activity = getattr(event, "activity_type", None)
    if activity is not None:
        return str(activity()) in DEVICE_ACTIVITIES
    return event.device_type() == torch.autograd.DeviceType.CUDA


def timeline_of(events: list[Any], window: Interval, has_device: bool) -> Timeline:
    """Sort Kineto events (`name()`, `start_ns()`, `end_ns()`, and `activity_type()` or
    `device_type()`) into device work and blocking host calls."""
    device, blocked = [], []
    for e in events:
        span = (int(e.start_ns()), int(e.end_ns()))
        if on_device(e):
            device.append(span)
        elif e.name() in BLOCKING_CALLS:
            blocked.append(span)
    return Timeline(window, device, blocked, has_device)


class StepTimeline:
    """Profile what runs inside the `with` block; `report(steps)` after it."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profile = profile(activities=activities)
        self.timeline: Timeline | None = None

    def __enter__(self) -> StepTimeline:
        self._sync()
        self._profile.__enter__()
        self._mark = record_function(WINDOW)  # the window, on the profiler's own clock
        self._mark.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self._mark.__exit__(*exc)
        self._profile.__exit__(*exc)
        events = list(self._profile.profiler.kineto_results.events())
        mark = next(e for e in events if e.name() == WINDOW)
        window = (int(mark.start_ns()), int(mark.end_ns()))
        self.timeline = timeline_of(events, window, self.cuda)

    def report(self, steps: int) -> dict[str, float | None]:
        assert self.timeline is not None, "report() after the with block"
        return self.timeline.report(steps)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
