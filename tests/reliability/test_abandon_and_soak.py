"""Abandoned streams leave nothing behind; the soak (long variant) has no failures.

CI: 10 streams dropped by their clients after the first event; the in-flight and queue
gauges return to 0 and a normal request still gets the same answer. With
DLM_RELIABILITY_LONG=1: 100 abandoned streams, and benchmarks/soak_rss.py for
DLM_SOAK_MINUTES (default 5) with the official openai client, no failure allowed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from reliability_stack import LONG_ENV, chat_body, long_runs, metric_value

from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ABANDONED = 100 if long_runs() else 10
LONG = {"max_tokens": 256, "steps": 256, "block_length": 32, "suppress_eos": True}


def _abandon(base: str) -> bool:
    """Open a stream, read until the first data line, hang up."""
    with (
        httpx.Client(timeout=60) as http,
        http.stream(
            "POST", f"{base}/v1/chat/completions", json={**chat_body(**LONG), "stream": True}
        ) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data:"):
                return True
    return False


def _answer(base: str) -> str:
    r = httpx.post(f"{base}/v1/chat/completions", json=chat_body(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_abandoned_streams_leave_nothing_behind(stack: TritonServerProcess) -> None:
    base = f"http://127.0.0.1:{stack.ports.proxy}"
    expected = _answer(base)
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(lambda _: _abandon(base), range(ABANDONED)))
    deadline = time.monotonic() + 60
    while metric_value(stack, "dlm_requests_in_flight") or metric_value(stack, "dlm_queue_depth"):
        assert time.monotonic() < deadline, "rows of abandoned streams are still held"
        time.sleep(0.2)
    assert _answer(base) == expected


@pytest.mark.skipif(not long_runs(), reason=f"long variant: set {LONG_ENV}=1")
def test_soak_has_no_failures(tmp_path: Path) -> None:
    minutes = os.environ.get("DLM_SOAK_MINUTES", "5")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak_rss.py"), "--minutes", minutes]
    subprocess.run([*cmd, "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=7200)
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(f"\nsoak: {summary}")
    assert summary["calls"] > 0 and summary["failures"] == 0 and summary["restarts"] == 0
