"""A big scoring request shares the engine's steps with generation (dlm_engine/scoring.py).

Scoring a 1,000-token prompt with `mc_samples` 1024 (completions `echo: true`, `max_tokens: 0`)
unshared would run a forward of 8 x 1,000 tokens in every engine step and slow a chat request
beside it many times over. Through the served stack: a neighbour's latency alone and beside such a
request (printed; docs/reliability.md records them), bounded generously (3x + 0.5 s: unshared
scoring is far past it, and timings on the shared 2-core machine vary). The big request is
then dropped by its client (its rows leave); a smaller scoring request of the same prompt run
beside neighbours completes with the numbers Triton gives it alone. Over-cap `mc_samples` and
prompts are 400s naming the field. The long variant lets the whole 1024-sample request finish.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from dlm_client import DLMClient
from reliability_stack import LONG_ENV, MODEL, chat_body, long_runs, metric_value

from dlm_protocol import limits
from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

NEIGHBOUR = chat_body(max_tokens=32, steps=32)
PROMPT = ("The quick brown fox jumps over the lazy dog. " * 23)[:1000]  # 1,000 tokens here
HOSTILE = {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0,
           "mc_samples": 1024, "seed": 1}  # fmt: skip


def _neighbour(http: httpx.Client, base: str) -> tuple[float, str]:
    t0 = time.monotonic()
    r = http.post(f"{base}/chat/completions", json=NEIGHBOUR)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0, r.json()["choices"][0]["message"]["content"]


def _send_and_hold(base: str, body: dict) -> socket.socket:
    """POST `body` to the proxy's completions and read nothing: the call runs until the socket
    is closed (the proxy then cancels it)."""
    url = urlsplit(base)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    head = (
        f"POST {url.path}/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_neighbour_keeps_its_latency_beside_hostile_scoring(
    stack: TritonServerProcess,
) -> None:
    base = stack.urls["openai"]
    in_flight = lambda: metric_value(stack, "dlm_requests_in_flight")  # noqa: E731
    with httpx.Client(timeout=600) as http:
        expected = _neighbour(http, base)[1]  # also warms the path
        alone = statistics.median(_neighbour(http, base)[0] for _ in range(5))

        sock = _send_and_hold(base, HOSTILE)
        try:
            _wait_for(lambda: in_flight() >= 1, "the scoring request never started")
            beside_runs = [_neighbour(http, base) for _ in range(5)]
            overlapped = in_flight() >= 1
        finally:
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        _wait_for(lambda: in_flight() == 0, "the dropped scoring request is still held")

    beside = statistics.median(s for s, _ in beside_runs)
    print(
        f"\nneighbour (32 steps): alone {alone:.3f}s, beside mc_samples 1024 x "
        f"{len(PROMPT)} tokens {beside:.3f}s (ratio {beside / alone:.2f})"
    )
    assert overlapped, "the scoring request ended before the neighbour was measured"
    assert all(text == expected for _, text in beside_runs)
    assert beside <= 3 * alone + 0.5, (alone, beside)


def test_scoring_beside_neighbours_completes_with_its_own_numbers(
    stack: TritonServerProcess,
) -> None:
    base = stack.urls["openai"]
    body = {**HOSTILE, "mc_samples": 16}
    scored: dict[str, httpx.Response] = {}

    def score() -> None:
        scored["r"] = httpx.post(f"{base}/completions", json=body, timeout=600)

    runner = threading.Thread(target=score, daemon=True)
    with httpx.Client(timeout=600) as http:
        runner.start()
        while runner.is_alive():
            _neighbour(http, base)
    runner.join()
    r = scored["r"]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["mc_samples"] == 16
    values = choice["logprobs"]["token_logprobs"]
    assert len(values) == len(PROMPT) and all(v < 0 for v in values)
    assert sum(values) == pytest.approx(choice["log_likelihood"], rel=1e-4)
    client = DLMClient(stack.urls["grpc"], stack.model_name, http_url=stack.urls["http"])
    alone = client.generate(PROMPT, score=True, mc_samples=16, seed=1)
    assert alone.score["log_likelihood"] == pytest.approx(choice["log_likelihood"], rel=1e-6)


@pytest.mark.skipif(not long_runs(), reason=f"long variant: set {LONG_ENV}=1")
def test_the_whole_hostile_request_completes(stack: TritonServerProcess) -> None:
    client = DLMClient(stack.urls["grpc"], stack.model_name, http_url=stack.urls["http"])
    t0 = time.monotonic()
    out = client.generate(PROMPT, score=True, mc_samples=1024, seed=1)
    print(f"\nmc_samples 1024 x {len(PROMPT)} tokens: {time.monotonic() - t0:.1f}s")
    assert out.score["mc_samples"] == 1024 and out.text == PROMPT
    assert sum(e["logprob"] for e in out.logprobs) == pytest.approx(
        out.score["log_likelihood"], rel=1e-4
    )


def test_scoring_over_a_cap_is_a_400_naming_the_field(stack: TritonServerProcess) -> None:
    base = stack.urls["openai"]
    small = {**HOSTILE, "prompt": "The cat sat.", "mc_samples": 8}
    # the prompt's field is named as the Triton contract calls it (text_input) for now
    for body, fields in (
        ({**small, "mc_samples": 1025}, ("mc_samples",)),
        ({**small, "prompt": "x" * (limits.MAX_PROMPT + 1)}, ("prompt", "text_input")),
    ):
        r = httpx.post(f"{base}/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in fields, r.text
    assert "the limit is" in r.json()["error"]["message"]
