"""SIGTERM to the proxy mid-stream: a new call during the drain gets 503 ``draining`` with
Retry-After (not "connection refused"), the running stream goes on, the proxy then exits 0."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from reliability_stack import ExtraProxy, chat_body, metric_value, proxy_stream

from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

# long enough (512 steps, several seconds even on a fast CPU) to still run during the drain
MEDIUM = {"max_tokens": 512, "steps": 512, "block_length": 32, "suppress_eos": True}


def test_new_call_while_draining_gets_503(stack: TritonServerProcess) -> None:
    # the drain waits for the running stream whatever the machine's speed: 512 steps took over
    # 60 s with both cores busy (a fresh-clone `make test-busy`), so the caps only catch a hang
    with ExtraProxy(stack, "--drain-timeout", "600") as proxy, ThreadPoolExecutor(1) as pool:
        running = pool.submit(proxy_stream, proxy.base_url, chat_body(**MEDIUM), 120)
        deadline = time.monotonic() + 30
        while metric_value(stack, "dlm_requests_in_flight") < 1:
            assert time.monotonic() < deadline, running.result() if running.done() else "no row"
            time.sleep(0.1)
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        r = httpx.post(f"{proxy.base_url}/v1/chat/completions", json=chat_body(), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        assert r.headers.get("retry-after")
        assert httpx.get(f"{proxy.base_url}/health", timeout=10).status_code == 503
        out = running.result(timeout=660)
        assert out.done and out.error is None, out  # the running stream was let finish
        assert proxy.proc.wait(timeout=30) == 0
