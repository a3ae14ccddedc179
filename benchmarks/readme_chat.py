"""The README's chat question, timed three ways on CPU: the in-process engine (ms per step,
1 and 2 torch threads), Triton gRPC, and the OpenAI proxy over HTTP (end to end).

    python benchmarks/readme_chat.py [--runs 10] [--warmup 3] [--out results.json]

Starts the embedded tiny-dlm on its own tritonserver and proxy (free ports, stopped by PID
at the end), as `make serve` does. Medians after warm-up; the CPU's model and flags are
printed with the figures because machines of one kind differ (AVX-512 BF16 or only AVX2).
The targets and the measured figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from dlm_client import DLMClient

from dlm_engine import Engine, EngineConfig
from dlm_protocol.settings import ASSETS_DIR
from dlm_triton.launch.launcher import Ports, TritonServerProcess

MODEL = "tiny-dlm"
QUESTION = "What is 1234 + 5678?"  # README.md's curl example
MESSAGES = [{"role": "user", "content": QUESTION}]


def cpu_description() -> dict[str, Any]:
    """CPU model name, core count and the flags that decide bf16 speed."""
    name, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return {
        "model": name,
        "cores": torch.get_num_threads(),
        "flags": [f for f in wanted if f in flags],
    }


def median_ms(samples: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(samples) * 1000, 2),
        "min_ms": round(min(samples) * 1000, 2),
        "max_ms": round(max(samples) * 1000, 2),
    }


def engine_figures(runs: int, warmup: int) -> dict[str, Any]:
    """In-process: seconds per request and per step, at 1 and 2 torch threads (interleaved,
    so both see the same machine noise)."""
    engine = Engine(EngineConfig(model=str(ASSETS_DIR / MODEL), device="cpu"))
    prompt = engine.encode_prompt(messages=MESSAGES)
    default_threads = torch.get_num_threads()
    per_request: dict[int, list[float]] = {1: [], 2: []}
    per_step: dict[int, list[float]] = {1: [], 2: []}
    text = ""
    for i in range(warmup + runs):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            engine.add_request(None, prompt, {})
            steps, t0 = 0, time.perf_counter()
            while engine.has_unfinished():
                outs = engine.step()
                steps += 1
            seconds = time.perf_counter() - t0
            text = outs[-1].text
            if i >= warmup:
                per_request[threads].append(seconds)
                per_step[threads].append(seconds / steps)
    torch.set_num_threads(default_threads)
    return {
        "prompt_tokens": len(prompt),
        "steps": steps,
        "answer": text,
        **{f"request_{t}_threads": median_ms(v) for t, v in per_request.items()},
        **{f"step_{t}_threads": median_ms(v) for t, v in per_step.items()},
    }


@contextmanager
def embedded_server() -> Iterator[TritonServerProcess]:
    """The embedded tiny-dlm on its own tritonserver and proxy, as `make serve` serves it
    (free ports), stopped by PID on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        server = TritonServerProcess(
            ASSETS_DIR / MODEL,
            model_name=MODEL,
            device="cpu",
            ports=Ports.free(),
            log_path=Path(tmp) / "triton.log",
            ready_timeout_s=300,
            exit_timeout_s=5,
            proxy=True,
        ).start()
        try:
            yield server
        finally:
            server.stop()


def served_figures(runs: int, warmup: int) -> dict[str, Any]:
    """Through Triton gRPC (dlm_client) and through the proxy (HTTP, non-streaming)."""
    grpc_s: list[float] = []
    proxy_s: list[float] = []
    answer = ""
    with embedded_server() as server, httpx.Client() as http:
        runtime = server.runtime()
        client = DLMClient(server.urls["grpc"], model=MODEL)
        url = server.urls["openai"] + "/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES}
        for i in range(warmup + runs):
            t0 = time.perf_counter()
            client.generate(messages=MESSAGES)
            t1 = time.perf_counter()
            r = http.post(url, json=body, timeout=60)
            t2 = time.perf_counter()
            r.raise_for_status()
            answer = r.json()["choices"][0]["message"]["content"]
            if i >= warmup:
                grpc_s.append(t1 - t0)
                proxy_s.append(t2 - t1)
    return {
        "runtime": runtime,
        "answer": answer,
        "triton_grpc": median_ms(grpc_s),
        "proxy_http": median_ms(proxy_s),
    }


def served_overhead(eng: dict[str, Any], srv: dict[str, Any]) -> dict[str, Any]:
    """What serving adds to the same request: the served medians minus the in-process
    request's median at the thread count the stub steps with (its `dlm_model_info`)."""
    threads = int(srv["runtime"].get("torch_threads") or 0)
    engine = eng.get(f"request_{threads}_threads")
    if engine is None:
        return {}
    base = engine["median_ms"]
    return {
        "threads": threads,
        "triton_grpc_ms": round(srv["triton_grpc"]["median_ms"] - base, 2),
        "proxy_http_ms": round(srv["proxy_http"]["median_ms"] - base, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = ap.parse_args()
    result = {
        "question": QUESTION,
        "cpu": cpu_description(),
        "engine": engine_figures(args.runs, args.warmup),
        "served": served_figures(args.runs, args.warmup),
    }
    eng, srv = result["engine"], result["served"]
    result["served_overhead"] = served_overhead(eng, srv)
    print(json.dumps(result["cpu"]))
    print(f"answer: engine {eng['answer']!r}, proxy {srv['answer']!r}; {eng['steps']} steps")
    print(f"stub runtime: {srv['runtime']}")
    for threads in (1, 2):
        step, req = eng[f"step_{threads}_threads"], eng[f"request_{threads}_threads"]
        print(
            f"engine, {threads} thread(s): step {step['median_ms']} ms (min {step['min_ms']}), "
            f"request {req['median_ms']} ms"
        )
    print(f"Triton gRPC end to end: {srv['triton_grpc']['median_ms']} ms (median)")
    print(f"OpenAI proxy end to end: {srv['proxy_http']['median_ms']} ms (median; goal <= 600)")
    over = result["served_overhead"]
    if over:
        print(
            f"served overhead over the engine alone at the stub's {over['threads']} thread(s): "
            f"Triton gRPC {over['triton_grpc_ms']} ms, proxy {over['proxy_http_ms']} ms "
            "(medians of separate runs; benchmarks/served_overhead.py pairs them)"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
