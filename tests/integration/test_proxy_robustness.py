"""The proxy under abuse, against a real tritonserver: malformed requests next to good streams,
client disconnects (the Triton row must be freed), Triton going away and coming back, auth,
and draining on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import proxy_fixtures
import pytest
from proxy_fixtures import ProxyProcess
from triton_metrics import read_metric, scrape, settled_metric

from dlm_triton.launch.launcher import Ports, TritonServerProcess, free_port

pytestmark = pytest.mark.integration

proxy = proxy_fixtures.proxy
model = proxy_fixtures.model

MSG = [{"role": "user", "content": "Say something."}]
# Long enough to be cancelled mid-way: 256 forwards over one 256-token block (seconds on CPU).
# Long enough to outlast the tests' short timeouts on any machine (no early end of text).
LONG = {"max_tokens": 1024, "steps": 1024, "block_length": 1024, "suppress_eos": True}


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def busy_rows(metric: Callable[..., float]) -> float:
    """Requests the model holds between execute() and their final response."""
    return metric("dlm_requests_in_flight")


def proxy_metric(p: ProxyProcess, name: str) -> float:
    with urllib.request.urlopen(p.base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


# ------------------------------------------------------------------------------------------------
# 30+ malformed requests while good streams run


def malformed_cases(model: str) -> list[tuple[str, str, Any, int]]:
    """(method, path, body (dict, bytes or None), expected status)."""
    chat = {"model": model, "messages": MSG, "max_tokens": 8}
    comp = {"model": model, "prompt": "hi", "max_tokens": 8}
    C, P = "/v1/chat/completions", "/v1/completions"

    def c(**kw: Any) -> dict[str, Any]:
        return {**chat, **kw}

    def p(**kw: Any) -> dict[str, Any]:
        return {**comp, **kw}

    return [
        ("POST", C, b"{not json", 400),
        ("POST", C, b"[1, 2, 3]", 400),
        ("POST", C, b"", 400),
        ("POST", C, {"messages": MSG}, 400),
        ("POST", C, {"model": model}, 400),
        ("POST", C, c(messages=[]), 400),
        ("POST", C, c(messages=[{"role": "tool", "content": "x"}]), 400),
        ("POST", C, c(messages=[{"role": "user", "content": None}]), 400),
        ("POST", C, c(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400),
        ("POST", C, c(temperature=-1), 400),
        ("POST", C, c(temperature=3), 400),
        ("POST", C, c(top_p=0), 400),
        ("POST", C, c(n=0), 400),
        ("POST", C, c(n=1000), 400),
        ("POST", C, c(max_tokens=0), 400),
        ("POST", C, c(max_tokens=10**7), 400),
        ("POST", C, c(seed=-5), 400),
        ("POST", C, c(logprobs=21), 400),
        ("POST", C, c(top_logprobs=2), 400),  # needs logprobs: true
        ("POST", C, c(tools=[{"type": "function"}]), 400),
        ("POST", C, c(tool_choice="required"), 400),  # needs tools
        ("POST", C, c(response_format={"type": "xml"}), 400),
        ("POST", C, c(presence_penalty=1.0), 400),
        ("POST", C, c(temprature=0.5), 400),
        ("POST", C, c(stream_mode="denoise"), 400),
        ("POST", C, c(stream=True, stream_mode="pixels"), 400),
        ("POST", C, c(algorithm="beam_search"), 400),
        ("POST", C, c(threshold=2), 400),
        ("POST", C, c(steps=0), 400),
        ("POST", C, c(steps=4, diffusion_steps=8), 400),
        ("POST", C, c(stop=[str(i) for i in range(17)]), 400),
        ("POST", C, c(max_tokens=8, max_completion_tokens=16), 400),
        ("POST", C, c(model="no-such-model"), 404),
        ("POST", C, c(max_tokens=10, block_length=3), 400),  # rejected by the model itself
        ("POST", C, c(max_tokens=10, block_length=3, stream=True), 400),
        ("POST", P, p(prompt=[]), 400),
        ("POST", P, p(prompt=[-1, 5]), 400),
        ("POST", P, p(prompt=[[1], "a"]), 400),
        ("POST", P, p(echo=True), 400),
        ("POST", P, p(suffix="tail"), 400),
        ("POST", P, p(best_of=3), 400),
        ("POST", P, b"x" * (2 << 20), 413),
        ("GET", C, None, 405),
        ("GET", "/v1/nowhere", None, 404),
    ]


async def _good_stream(client: httpx.AsyncClient, model: str, i: int) -> str:
    body = {"model": model, "messages": MSG, "max_tokens": 32, "stream": True, "seed": i}
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = sse_events(lines)
    assert not any("error" in e for e in events), events
    for e in events:
        text += e["choices"][0]["delta"].get("content") or ""
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    return text


def test_malformed_requests_get_clear_4xx_while_good_streams_complete(
    proxy: ProxyProcess, model: str
) -> None:
    cases = malformed_cases(model)
    assert len(cases) >= 30

    async def one(client: httpx.AsyncClient, case: tuple[str, str, Any, int]) -> None:
        method, path, body, status = case
        kw: dict[str, Any] = {}
        if isinstance(body, bytes):
            kw = {"content": body, "headers": {"content-type": "application/json"}}
        elif body is not None:
            kw = {"json": body}
        r = await client.request(method, path, **kw)
        assert r.status_code == status, (case, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], case
        assert "Traceback" not in r.text

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=120) as client:
            good = [asyncio.create_task(_good_stream(client, model, i)) for i in range(3)]
            await asyncio.gather(*(one(client, case) for case in cases))
            return await asyncio.gather(*good)

    texts = asyncio.run(run())
    assert len(texts) == 3


# ------------------------------------------------------------------------------------------------
# Startup objects frozen out of the cyclic collector's sight


def test_proxy_and_model_freeze_their_startup_objects(
    proxy: ProxyProcess, metric: Callable[..., float]
) -> None:
    """Both processes freeze what they loaded (gc.freeze), so a full collection never stops
    the proxy's event loop or the engine thread for long: each reports the frozen count, and
    a loaded app or model is tens of thousands of objects, not a handful."""
    assert proxy_metric(proxy, "dlm_proxy_gc_frozen_objects") > 10_000
    assert metric("dlm_gc_frozen_objects") > 10_000


def test_model_reports_kernel_fallbacks_and_graph_captures(
    triton_server: TritonServerProcess,
) -> None:
    """What a dashboard watches for a silent slow-down: compiled kernels that fell back to
    eager, and CUDA graphs captured inside steps. Both are there, and on the CPU, where
    nothing is compiled or captured, both are 0."""
    samples = {name: v for (name, _labels), v in scrape(triton_server).items()}
    assert samples["dlm_fused_kernel_fallbacks"] == 0
    assert samples["dlm_cuda_graph_captures_total"] == 0  # no CUDA graphs on the CPU


# ------------------------------------------------------------------------------------------------
# Client disconnects free the Triton row


def test_stream_disconnect_frees_the_row(
    proxy: ProxyProcess, model: str, metric: Callable[..., float]
) -> None:
    aborts = metric("dlm_requests_total", outcome="abort")
    cancelled = proxy_metric(proxy, "dlm_proxy_triton_streams_cancelled_total")
    body = {"model": model, "prompt": "hello", "stream": True, "stream_mode": "denoise", **LONG}
    with (
        httpx.Client(base_url=proxy.base_url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if '"canvas"' in line:
                seen += 1
                if seen == 3:
                    break
        assert metric("dlm_requests_total", outcome="abort") == aborts, "not cancelled yet"
    # The connection is closed here, mid-generation (the request needs 256 forwards).
    wait_for(
        lambda: metric("dlm_requests_total", outcome="abort") == aborts + 1,
        15,
        "Triton to count the request as aborted",
    )
    wait_for(lambda: busy_rows(metric) == 0, 15, "the row to leave the batch")
    assert proxy_metric(proxy, "dlm_proxy_triton_streams_cancelled_total") == cancelled + 1


def test_non_streaming_disconnect_frees_the_row(
    proxy: ProxyProcess, model: str, metric: Callable[..., float]
) -> None:
    aborts = metric("dlm_requests_total", outcome="abort")
    body = {"model": model, "prompt": "hello", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            proxy.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5)
        )
    wait_for(
        lambda: metric("dlm_requests_total", outcome="abort") == aborts + 1,
        15,
        "Triton to count the request as aborted",
    )
    wait_for(lambda: busy_rows(metric) == 0, 15, "the row to leave the batch")


# ------------------------------------------------------------------------------------------------
# Auth on and off


def test_auth_on(triton_server: TritonServerProcess, model: str, tmp_path: Path) -> None:
    p = ProxyProcess(
        [triton_server.urls["grpc"]],
        ["--api-key", "k-one", "--api-key", "k-two"],
        log_path=tmp_path / "proxy.log",
    ).start()
    try:
        with pytest.raises(openai.AuthenticationError) as info:
            p.client(api_key="wrong").chat.completions.create(model=model, messages=MSG)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        missing = httpx.post(
            p.base_url + "/v1/chat/completions", json={"model": model, "messages": MSG}
        )
        assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            p.client(api_key="nope").models.list()
        r = p.client(api_key="k-two").chat.completions.create(
            model=model, messages=MSG, max_tokens=8
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        stream = p.client(api_key="k-one").chat.completions.create(
            model=model, messages=MSG, max_tokens=8, stream=True
        )
        assert list(stream)
        assert httpx.get(p.base_url + "/health").status_code == 200  # probes need no key
    finally:
        p.stop()


def test_auth_off_accepts_any_key(proxy: ProxyProcess, model: str) -> None:
    for key in ("anything", "sk-123"):
        r = proxy.client(api_key=key).chat.completions.create(
            model=model, messages=MSG, max_tokens=4
        )
        assert r.choices
    assert httpx.post(
        proxy.base_url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 4}
    ).is_success


# ------------------------------------------------------------------------------------------------
# Triton stopped -> 503 (Retry-After), back after a restart


def test_triton_stopped_gives_503_then_recovers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = "tiny-restart"
    triton = TritonServerProcess(
        tiny_checkpoint,
        model_name=name,
        device="cpu",
        ports=Ports.free(),
        log_path=tmp_path / "triton.log",
        ready_timeout_s=180,
        exit_timeout_s=5,
    )
    triton.start()
    p: ProxyProcess | None = None
    try:
        p = ProxyProcess([triton.urls["grpc"]], log_path=tmp_path / "proxy.log").start()
        client = p.client()
        body = {"model": name, "prompt": "hello", "max_tokens": 8}
        before = client.completions.create(**body).choices[0].text

        # A stream in flight when Triton goes away must end (finished by the launcher's drain,
        # or with an error event), never hang.
        outcome: dict[str, Any] = {}
        started = threading.Event()

        def long_stream() -> None:
            try:
                stream = client.completions.create(
                    model=name,
                    prompt="hello",
                    stream=True,
                    # streamed text must start soon (blocks of 32) and the whole lasts long
                    max_tokens=512,
                    extra_body={"steps": 512, "block_length": 32, "suppress_eos": True},
                )
                outcome["chunks"] = 0
                for _ in stream:
                    outcome["chunks"] += 1
                    started.set()
            except openai.APIError as exc:
                outcome["error"] = exc
            finally:
                started.set()

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(60)
        triton.stop()
        t.join(timeout=60)
        assert not t.is_alive(), "the stream must end when Triton goes away"
        assert outcome.get("chunks") or "error" in outcome, outcome

        r = httpx.post(p.base_url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) > 0
        assert r.json()["error"]["type"] == "service_unavailable"
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=name, messages=MSG, max_tokens=4, stream=True)
        assert info.value.status_code == 503
        health = httpx.get(p.base_url + "/health")
        assert health.status_code == 503 and "retry-after" in health.headers

        triton.start()  # same ports
        recovered: list[str] = []

        def works() -> bool:
            r = httpx.post(p.base_url + "/v1/completions", json=body, timeout=30)
            if r.status_code == 200:
                recovered.append(r.json()["choices"][0]["text"])
            return bool(recovered)

        wait_for(works, 60, "the proxy to serve again after Triton restarted")
        assert recovered[0] == before  # same checkpoint, greedy: same text
        assert httpx.get(p.base_url + "/health").status_code == 200
    finally:
        if p is not None:
            p.stop()
        triton.stop()


# ------------------------------------------------------------------------------------------------
# Drain on SIGTERM


def test_sigterm_drains_running_streams(
    triton_server: TritonServerProcess, model: str, tmp_path: Path
) -> None:
    p = ProxyProcess([triton_server.urls["grpc"]], log_path=tmp_path / "proxy.log").start()
    try:
        body = {
            "model": model, "prompt": "hello", "stream": True, "stream_mode": "denoise",
            "max_tokens": 64, "steps": 64, "block_length": 64,
        }  # fmt: skip
        lines: list[str] = []
        with httpx.stream("POST", p.base_url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 2:
                    p.terminate()  # mid-stream
        assert lines[-1] == "data: [DONE]", lines[-3:]
        events = sse_events(lines)
        assert not any("error" in e for e in events)
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert p.proc is not None and p.proc.wait(timeout=30) == 0
    finally:
        p.stop()


# ------------------------------------------------------------------------------------------------
# Several Triton URLs: dead ones are skipped, live ones share the load


def test_dead_triton_url_is_skipped(
    triton_server: TritonServerProcess, model: str, tmp_path: Path
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    p = ProxyProcess([dead, triton_server.urls["grpc"]], log_path=tmp_path / "proxy.log").start()
    try:
        client = p.client()
        for _ in range(4):
            r = client.completions.create(model=model, prompt="hello", max_tokens=4)
            assert r.choices[0].finish_reason in ("stop", "length")
        health = httpx.get(p.base_url + "/health").json()
        assert health["status"] == "ok"
        assert {h["url"]: h["ready"] for h in health["triton"]} == {
            dead: False,
            triton_server.urls["grpc"]: True,
        }
    finally:
        p.stop()


def test_requests_are_spread_over_ready_tritons(
    triton_server: TritonServerProcess,
    tiny_checkpoint: Path,
    server_factory: Callable[..., TritonServerProcess],
    tmp_path: Path,
) -> None:

    # The same model name on a second server, as a replica would be deployed.
    second = server_factory(tiny_checkpoint, name=triton_server.model_name)
    servers = [triton_server, second]

    def finished(s: TritonServerProcess) -> float:
        """Recorded just after each final response (settled: the last may be a moment late)."""
        settled_metric(s, "dlm_request_latency_seconds_count")
        return sum(read_metric(s, "dlm_requests_total", outcome=o) for o in ("stop", "length"))

    before = [finished(s) for s in servers]
    p = ProxyProcess([s.urls["grpc"] for s in servers], log_path=tmp_path / "proxy.log").start()
    try:
        client = p.client()
        texts = {
            client.completions.create(model=second.model_name, prompt="hello", max_tokens=8)
            .choices[0]
            .text
            for _ in range(6)
        }
        assert len(texts) == 1  # replicas of one checkpoint answer alike
        served = [finished(s) - b for s, b in zip(servers, before, strict=True)]
        assert sum(served) == 6
        assert all(n >= 2 for n in served), f"round-robin should use both servers: {served}"
    finally:
        p.stop()


def test_request_timeout_is_504_and_frees_the_row(
    triton_server: TritonServerProcess,
    model: str,
    metric: Callable[..., float],
    tmp_path: Path,
) -> None:
    p = ProxyProcess(
        [triton_server.urls["grpc"]], ["--request-timeout", "0.3"], log_path=tmp_path / "p.log"
    ).start()
    try:
        aborts = metric("dlm_requests_total", outcome="abort")
        r = httpx.post(
            p.base_url + "/v1/completions",
            json={"model": model, "prompt": "hello", **LONG},
            timeout=60,
        )
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "timeout"
        wait_for(
            lambda: metric("dlm_requests_total", outcome="abort") == aborts + 1,
            15,
            "Triton to abort the timed-out request",
        )
        # Streaming: once the headers are out, the timeout arrives as an error event; on a
        # machine too slow for the first step to beat the timeout it is a plain 504.
        body = {"model": model, "prompt": "hello", "stream": True, "stream_mode": "denoise", **LONG}
        with httpx.stream("POST", p.base_url + "/v1/completions", json=body, timeout=60) as s:
            status = s.status_code
            lines = [line for line in s.iter_lines() if line]
        if status == 504:
            assert json.loads("".join(lines))["error"]["type"] == "timeout"
        else:
            assert status == 200 and lines[-1] == "data: [DONE]"
            assert sse_events(lines)[-1]["error"]["type"] == "timeout"
    finally:
        p.stop()
