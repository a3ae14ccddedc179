"""Throughput of 1, 2, 3 ... Triton replicas behind one proxy, on this machine.

Starts N tritonservers for one model (the launcher, as `dlm-triton serve --no-proxy` does), one
OpenAI proxy over all of them, sends the same fixed number of requests at a fixed concurrency,
and prints one JSON line per replica count: requests/s, completion tokens/s, latency
percentiles, and how the proxy spread the requests (its per-replica counters). The requests
are tiny-dlm's held-out chat tasks (dlm_lab/training/tasks.py)::

    python benchmarks/replicas.py --replicas 1,2,3 --requests 48 --concurrency 6

On a CPU-only host every replica competes for the same cores, so more replicas only help while
cores are idle; on GPUs, one replica per GPU, the figure scales with the GPUs. Stops by request
count, never by time. Nothing here asserts: tests/integration/test_replicas.py does.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlm_lab.training import tasks  # noqa: E402
from dlm_triton.launch.launcher import Ports, TritonServerProcess, free_port  # noqa: E402
from dlm_triton.launch.procs import http_ok, spawn, terminate  # noqa: E402


def start_proxy(grpc_urls: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "openai_proxy", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *[a for u in grpc_urls for a in ("--triton-url", u)]]  # fmt: skip
    proc = spawn(cmd, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT)  # dies with us
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not http_ok(base + "/health"):
        if proc.poll() is not None:
            raise RuntimeError(f"proxy exited: see {log}")
        time.sleep(0.3)
    return proc, base


def replica_counts(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    pattern = r'^dlm_proxy_replica_attempts_total\{replica="([^"]+)"\} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def run_one(
    base: str, model: str, body: dict[str, object], n: int, concurrency: int
) -> dict[str, object]:
    latencies: list[float] = []
    tokens = 0
    errors = 0

    # tiny-dlm's own tasks (copy, sort, add ...): real answers of a few to tens of tokens.
    questions = [tasks.messages_for(ex) for ex in tasks.heldout_examples(n)]

    def call(i: int) -> tuple[float, int, bool]:
        t0 = time.perf_counter()
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"model": model, "messages": questions[i], **body},
            timeout=600,
        )
        ok = r.status_code == 200
        used = r.json()["usage"]["completion_tokens"] if ok else 0
        return time.perf_counter() - t0, used, ok

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for latency, used, ok in ex.map(call, range(n)):
            latencies.append(latency)
            tokens += used
            errors += not ok
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=10)
    return {
        "requests": n,
        "errors": errors,
        "wall_s": round(wall, 2),
        "requests_per_s": round(n / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "p50_s": round(statistics.median(latencies), 3),
        "p90_s": round(q[-1], 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-dlm", help="name in model_repository/ or checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--replicas", default="1,2,3", help="comma-separated replica counts")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args(argv)
    body = {"max_tokens": args.max_tokens, "steps": args.steps}
    logs = Path(tempfile.mkdtemp(prefix="dlm-replicas-bench-"))
    for count in [int(x) for x in args.replicas.split(",")]:
        servers: list[TritonServerProcess] = []
        proxy: subprocess.Popen | None = None
        try:
            for i in range(count):
                servers.append(
                    TritonServerProcess(
                        args.model, device=args.device, ports=Ports.free(),
                        log_path=logs / f"triton-{count}-{i}.log", exit_timeout_s=5,
                    ).start()
                )  # fmt: skip
            proxy, base = start_proxy([s.urls["grpc"] for s in servers], logs / "proxy.log")
            model = servers[0].model_name
            run_one(base, model, body, min(4, args.requests), min(2, args.concurrency))  # warm-up
            before = replica_counts(base)
            result = run_one(base, model, body, args.requests, args.concurrency)
            after = replica_counts(base)
            result["per_replica_requests"] = [int(after[u] - before.get(u, 0)) for u in after]
            print(json.dumps({"replicas": count, "model": model, **body, **result}), flush=True)
        finally:
            if proxy is not None:
                terminate(proxy, timeout=30)
            for s in servers:
                s.stop()
    print(f"logs: {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
