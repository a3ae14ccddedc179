"""A dead model is a known state.

``kill -9`` of the Python backend stub, then of tritonserver itself, with requests in flight
through the proxy, gRPC and Triton HTTP: every in-flight request ends with an error within
30 s, health turns non-200 within 30 s, no answer is a 500, the supervisor restarts the server
and the stack answers correctly again within 3 minutes, counted in dlm_model_restarts_total.
Only processes this test started are killed, by PID.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from dlm_client import DLMClient
from reliability_stack import (
    LONG_ENV,
    chat_body,
    long_runs,
    metric_value,
    proxy_stream,
    status_of,
)

from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

# long enough to be in flight when the kill comes (thousands of forwards on a tiny model)
LONG = {"max_tokens": 1024, "steps": 1024, "block_length": 32, "suppress_eos": True}
ERROR_WITHIN_S = 30
RECOVER_WITHIN_S = 180


def _grpc_outcome(client: DLMClient) -> tuple[str | None, float]:
    try:
        for _ in client.stream("Count to a thousand.", **LONG):
            pass
        return None, time.monotonic()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic()


def _http_outcome(client: DLMClient) -> tuple[str | None, float]:
    try:
        for _ in client.stream_http("Count to a thousand.", **LONG):
            pass
        return None, time.monotonic()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic()


def _kill_under_load(stack: TritonServerProcess, victim: Callable[[], int]) -> None:
    base = f"http://127.0.0.1:{stack.ports.proxy}"
    triton_ready = f"{stack.urls['http']}/v2/models/{stack.model_name}/ready"
    client = DLMClient(stack.urls["grpc"], stack.model_name, http_url=stack.urls["http"])
    expected = _answer(base)
    restarts = stack.restarts
    log_before = len(stack.restart_log)
    shm_before = stack.shm_files()

    with ThreadPoolExecutor(8) as pool:
        proxy_calls = [pool.submit(proxy_stream, base, chat_body(**LONG)) for _ in range(3)]
        grpc_calls = [pool.submit(_grpc_outcome, client) for _ in range(2)]
        http_calls = [pool.submit(_http_outcome, client)]
        deadline = time.monotonic() + 60
        while metric_value(stack, "dlm_requests_in_flight") < 6:
            assert time.monotonic() < deadline, "the load never got in flight"
            time.sleep(0.2)
        pid = victim()
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)

        # health goes non-200 (Triton and the proxy); new requests are 503 + Retry-After
        seen = {"triton": None, "proxy": None}
        new_statuses: list[tuple[int, str | None]] = []
        while time.monotonic() - killed_at < ERROR_WITHIN_S and None in seen.values():
            for key, url in (("triton", triton_ready), ("proxy", f"{base}/health")):
                if seen[key] is None and status_of(url) != 200:
                    seen[key] = time.monotonic() - killed_at
            time.sleep(0.1)
        r = _post(base, chat_body())
        new_statuses.append((r.status_code, r.headers.get("retry-after")))

        outcomes = [f.result(timeout=ERROR_WITHIN_S + 30) for f in proxy_calls]
        grpc_results = [f.result(timeout=ERROR_WITHIN_S + 30) for f in grpc_calls + http_calls]

    for name, after in seen.items():
        assert after is not None, f"{name} health stayed 200 for {ERROR_WITHIN_S}s after the kill"
    for out in outcomes:
        if out.status == 200:  # headers were out: an SSE error event ends the stream
            assert out.error and not out.done, out
        else:  # no event yet: a real 503 the client may retry
            assert out.status == 503 and out.retry_after, out
        assert out.ended_at - killed_at < ERROR_WITHIN_S, out
        assert all(e["error"]["type"] != "server_error" for e in out.events), out  # no "500"
    for error, ended_at in grpc_results:
        assert error is not None and ended_at - killed_at < ERROR_WITHIN_S, error
    for status, retry_after in new_statuses:
        assert status != 500
        if status == 503:
            assert retry_after is not None

    # back by itself, answering as before, counted
    deadline = killed_at + RECOVER_WITHIN_S
    while True:
        r = _post(base, chat_body())
        assert r.status_code != 500, r.text
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, f"not back within {RECOVER_WITHIN_S}s: {r.text}"
        time.sleep(0.5)
    assert r.json()["choices"][0]["message"]["content"] == expected
    # The supervisor records the restart once its own readiness poll returns, which can be a
    # poll interval after the model first answers a request.
    record_deadline = time.monotonic() + 30
    while len(stack.restart_log) < log_before + 1:
        assert time.monotonic() < record_deadline, "the supervisor never recorded the restart"
        time.sleep(0.1)
    ends = [o.ended_at for o in outcomes] + [t for _, t in grpc_results]
    print(  # the figures docs/reliability.md records (pytest -s)
        f"\nkill -9: in-flight ended {min(ends) - killed_at:.1f}-{max(ends) - killed_at:.1f}s, "
        f"health non-200 after {seen}, new request {new_statuses}, "
        f"answering again after {time.monotonic() - killed_at:.1f}s, {stack.restart_log[-1]}"
    )
    assert stack.restarts == restarts + 1
    assert metric_value(stack, "dlm_model_restarts_total") == stack.restarts
    assert shm_before and not any(p.exists() for p in shm_before)  # the dead server's shm


def _post(base: str, body: dict):
    import httpx

    try:
        return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    except httpx.HTTPError as exc:  # the proxy itself must stay up: count as a failure
        raise AssertionError(f"proxy unreachable: {exc}") from exc


def _answer(base: str) -> str:
    r = _post(base, chat_body())
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_stub_killed_under_load(stack: TritonServerProcess) -> None:
    _kill_under_load(stack, lambda: stack.stub_pids()[0])


@pytest.mark.skipif(not long_runs(), reason=f"long variant: set {LONG_ENV}=1 (~30 s more)")
def test_tritonserver_killed_under_load(stack: TritonServerProcess) -> None:
    assert stack.server is not None
    _kill_under_load(stack, lambda: stack.server.pid)
