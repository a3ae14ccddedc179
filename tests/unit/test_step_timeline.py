"""benchmarks/step_timeline.py: the device-busy fraction is the union of the device's
intervals over the window, host time per step the window less the time blocked in device
synchronisation; on the CPU (no device) a real profiled engine run reports host time only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location(
        "step_timeline", ROOT / "benchmarks" / "step_timeline.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_timeline"] = module
    spec.loader.exec_module(module)
    return module


class _Event:
    def __init__(self, name: str, kind: str, start: int, end: int) -> None:
        self._name, self._kind, self._start, self._end = name, kind, start, end

    def name(self) -> str:
        return self._name

    def activity_type(self) -> str:
        return self._kind

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end


def test_union_counts_overlaps_once(timeline) -> None:
    assert timeline.union_ns([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert timeline.union_ns([]) == 0
    assert timeline.clip([(0, 10), (90, 120), (200, 300)], (5, 100)) == [(5, 10), (90, 100)]


def test_busy_fraction_and_host_time(timeline) -> None:
    events = [
        _Event("gemm", "kernel", 100, 400),
        _Event("norm", "kernel", 350, 500),  # overlaps: counted once
        _Event("copy", "gpu_memcpy", 700, 800),
        _Event("cudaStreamSynchronize", "cuda_runtime", 500, 800),
        _Event("cudaLaunchKernel", "cuda_runtime", 90, 95),  # not blocking
        _Event("aten::mm", "cpu_op", 0, 1000),
    ]
    report = timeline.timeline_of(events, (0, 1000), has_device=True).report(steps=2)
    assert report["device_busy"] == pytest.approx(0.5)  # 100-500 and 700-800 of 0-1000
    assert report["blocked_ms"] == pytest.approx(300 / 1e6)
    assert report["host_ms_per_step"] == pytest.approx(700 / 2 / 1e6)


class _OlderEvent:
    """An event of a PyTorch whose Kineto events have a device type but no activity type."""

    def __init__(self, name: str, on_gpu: bool, start: int, end: int) -> None:
        self._name, self._on_gpu, self._start, self._end = name, on_gpu, start, end

    def name(self) -> str:
        return self._name

    def device_type(self):
        import torch

        return torch.autograd.DeviceType.CUDA if self._on_gpu else torch.autograd.DeviceType.CPU

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._end


def test_events_without_an_activity_type_sort_by_device(timeline) -> None:
    events = [
        _OlderEvent("gemm", True, 100, 400),
        _OlderEvent("Memcpy DtoH", True, 700, 800),
        _OlderEvent("cudaStreamSynchronize", False, 500, 800),
        _OlderEvent("cudaLaunchKernel", False, 90, 95),
        _OlderEvent("aten::mm", False, 0, 1000),
    ]
    report = timeline.timeline_of(events, (0, 1000), has_device=True).report(steps=2)
    assert report["device_busy"] == pytest.approx(0.4)
    assert report["blocked_ms"] == pytest.approx(300 / 1e6)


def test_a_cpu_engine_run_reports_host_time_only(timeline, engines) -> None:
    eng = engines["llada"]
    with timeline.StepTimeline() as t:
        outs = eng.generate([[5, 6, 7]], {"max_tokens": 8, "steps": 4})
    report = t.report(steps=outs[0].steps)
    assert report["device_busy"] is None  # no device profiled
    assert report["blocked_ms"] == 0.0
    assert 0 < report["host_ms_per_step"] * 4 <= report["wall_ms"] + 1e-9
