"""Correctness under churn: a few hundred requests at random times, with random settings,
client cancellations and proxy disconnects, against a real tritonserver (tiny-dlm) and proxy.

Every request that completes must equal the same request run alone in-process; afterwards no
row, queue entry or cache slot is left (cached requests beyond every KV row still run), no
stub or shared-memory region is left by the server, and the stub's memory is flat.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from dlm_client import DLMClient
from embedded_server import embedded_server as serve_embedded
from proxy_fixtures import ProxyProcess
from triton_metrics import read_metric

from dlm_engine import Engine, EngineConfig
from dlm_lab.training.tasks import heldout_examples, messages_for
from dlm_protocol.settings import ASSETS_DIR

pytestmark = pytest.mark.integration

N_REQUESTS = 120
MAX_ROWS = 8
SPREAD_S = 4.0  # arrivals spread uniformly over this window
ROUNDS = 3  # memory is sampled after each; the last round must not grow it
CONCURRENCY = 24  # client threads at most in flight at once


def random_settings(rng: random.Random, engine: Engine) -> dict:
    """A valid random mix of the diffusion settings (validated by the engine itself)."""
    while True:
        max_tokens = rng.choice([8, 16, 24])
        block = rng.choice([b for b in (4, 8, max_tokens) if max_tokens % b == 0])
        per_block = rng.choice([1, 2, 4])
        s = {
            "max_tokens": max_tokens,
            "block_length": block,
            "steps": max(1, max_tokens // block) * max(1, block // per_block),
            "algorithm": rng.choice(["low_confidence", "topk_margin", "entropy", "threshold"]),
            "cache": rng.choice(["none", "none", "prefix", "dual"]),
        }
        if rng.random() < 0.3:
            s.update(temperature=0.7, seed=rng.randrange(1 << 20))
        try:
            engine.resolve_params(s)
        except Exception:
            continue
        return s


def alone(engine: Engine, messages: list[dict], settings: dict) -> tuple[str, str]:
    engine.add_request("alone", engine.encode_prompt(messages=messages), settings)
    final = [o for o in engine.outputs() if o.finished]
    return final[0].text, final[0].finish_reason


@pytest.fixture(scope="module")
def churn_stack(tmp_path_factory: pytest.TempPathFactory):
    """tiny-dlm on its own tritonserver (clean gauges and memory) with a proxy in front."""
    logs = tmp_path_factory.mktemp("churn")
    with serve_embedded(
        logs, ready_timeout_s=300, engine_params={"max_rows": str(MAX_ROWS)}
    ) as server:
        proxy = ProxyProcess([server.urls["grpc"]], log_path=logs / "proxy.log")
        try:
            proxy.start(timeout_s=60)
            yield server, proxy
        finally:
            proxy.stop()


def stub_rss_mb(server) -> float:
    total = 0.0
    for pid in server.stub_pids():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def test_churn_answers_equal_alone_and_nothing_leaks(churn_stack) -> None:
    server, proxy = churn_stack
    client = DLMClient(server.urls["grpc"], server.model_name)
    engine = Engine(EngineConfig(model=str(ASSETS_DIR / "tiny-dlm"), device="cpu"))
    rng = random.Random(20261123)
    examples = heldout_examples(N_REQUESTS, seed=99)
    plan = []
    for i, ex in enumerate(examples):
        kind = rng.choices(["grpc", "grpc_cancel", "proxy", "proxy_disconnect"], [6, 1, 2, 1])[0]
        plan.append((i, kind, messages_for(ex), random_settings(rng, engine), rng.random()))

    # warm-up (first shapes, lazy imports), then the baseline memory
    client.generate(messages=plan[0][2], **plan[0][3])
    shm0 = {p.name for p in server.shm_files()}

    results: dict[int, tuple[str, str]] = {}
    errors: dict[int, str] = {}
    gate = threading.Semaphore(CONCURRENCY)

    def run(i: int, kind: str, messages: list[dict], settings: dict, at: float) -> None:
        time.sleep(max(0.0, t0 + at * SPREAD_S - time.monotonic()))
        with gate:
            try:
                if kind == "grpc":
                    c = client.generate(messages=messages, stream=True, **settings)
                    results[i] = (c.text, c.finish_reason)
                elif kind == "grpc_cancel":
                    stream = client.stream(messages=messages, stream_mode="denoise", **settings)
                    next(stream)
                    stream.close()  # a client cancel mid-generation
                elif kind == "proxy":
                    results[i] = proxy_chat(proxy.base_url, server.model_name, messages, settings)
                else:
                    proxy_disconnect(proxy.base_url, server.model_name, messages, settings)
            except Exception as exc:
                errors[i] = f"{kind}: {type(exc).__name__}: {exc}"

    rss = [stub_rss_mb(server)]
    per_round = len(plan) // ROUNDS
    for r in range(ROUNDS):
        t0 = time.monotonic()
        part = plan[r * per_round : (r + 1) * per_round]
        threads = [threading.Thread(target=run, args=p, daemon=True) for p in part]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not [t for t in threads if t.is_alive()], "a request hung"
        rss.append(stub_rss_mb(server))
        print(f"round {r}: {time.monotonic() - t0:.1f}s, stub RSS {rss[-1]:.0f} MB")
    assert not errors, list(errors.values())[:5]
    assert len(results) >= N_REQUESTS // 2

    t_alone = time.monotonic()
    mismatches = []
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's stub runs beside this process on the same cores
    try:
        for i, kind, messages, settings, _ in plan:
            if i in results:
                want = alone(engine, messages, settings)
                if results[i] != want:
                    mismatches.append((i, kind, settings, results[i], want))
    finally:
        torch.set_num_threads(threads_before)
    print(f"alone runs: {time.monotonic() - t_alone:.1f}s")
    assert not mismatches, mismatches[:3]

    # nothing left running or queued, on the engine's own gauges
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (
            read_metric(server, "dlm_requests_in_flight"),
            read_metric(server, "dlm_queue_depth"),
        ) == (0, 0):
            break
        time.sleep(0.2)
    assert read_metric(server, "dlm_requests_in_flight") == 0
    assert read_metric(server, "dlm_queue_depth") == 0
    # every KV row is free again: more cached requests at once than there are rows still run
    ids = engine.encode_prompt(messages=plan[0][2])
    cached = {"max_tokens": 8, "block_length": 4, "steps": 4, "cache": "dual"}
    finals = [None] * (MAX_ROWS + 4)

    def cached_one(k: int) -> None:
        finals[k] = client.generate(input_ids=ids, **cached).finish_reason

    burst = [threading.Thread(target=cached_one, args=(k,)) for k in range(len(finals))]
    for t in burst:
        t.start()
    for t in burst:
        t.join(timeout=120)
    assert all(f in ("stop", "length") for f in finals), finals
    # no new shared-memory regions, and memory flat (allocator noise allowed, not growth)
    assert {p.name for p in server.shm_files()} == shm0
    print("stub RSS after warm-up and each round (MB):", [round(x) for x in rss])
    last = rss[-1] - rss[-2]
    assert last < 32, f"stub RSS still grew {last:.0f} MB in the last round: {rss}"


def proxy_chat(url: str, model: str, messages: list[dict], settings: dict) -> tuple[str, str]:
    """A streamed chat completion through the proxy: (joined text, finish_reason)."""
    body = {"model": model, "messages": messages, "stream": True, **settings}
    text, finish = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def proxy_disconnect(url: str, model: str, messages: list[dict], settings: dict) -> None:
    """Open a denoise stream through the proxy and drop the connection after the first event."""
    body = {"model": model, "messages": messages, "stream": True, "stream_mode": "denoise"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, **settings}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
