"""Arrival-driven benchmark: requests arrive over time, as real clients do, not all at once.

For each arrival process (all at once, fixed gaps, Poisson at a fraction of the saturated rate,
bursts) it replays N requests against one target and reports throughput, time to the first
stable text (TTFT), end-to-end latency p50/p95/p99 and goodput: requests per second that finish
within a stated latency target (the SLO). Ratios against simultaneous arrivals are taken within
the same run, so they compare like with like.

Targets:
- ``engine``: the in-process engine on ``--device`` (GPU: random bf16 weights of a published
  architecture, ``--model random:llada-8b``; CPU: the embedded tiny-dlm by default). Random
  weights never stop early, so each request runs its fixed schedule and the timing is honest;
  on tiny-dlm answers are real and stop early.
- ``triton``: a running tritonserver over gRPC streams (``--url host:8001``), one thread per
  request, through ``dlm_client``.
- ``proxy``: a running OpenAI proxy (``--url http://host:9000``), streamed chat completions.

    python benchmarks/traffic.py --target engine --device cuda --model random:llada-8b \\
        --requests 8,32 --caches none,dual --out traffic_out
    python benchmarks/traffic.py --target engine --device cpu --requests 8 --out /tmp/traffic
    python benchmarks/traffic.py --target proxy --url http://127.0.0.1:9000 --model tiny-dlm
    python benchmarks/traffic.py --target triton --serve --device cuda --model random:llada-8b \
        --requests 8,32 --caches dual      # starts (and stops) tritonserver itself

Arrival specs (``--arrivals``): ``all`` (simultaneous), ``gap:100`` (100 ms apart),
``poisson:0.8`` (Poisson at 0.8x the saturated request rate measured by ``all`` in this run),
``burst:4:500`` (groups of 4 every 500 ms).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROMPT, CANVAS, BLOCK, STEPS = 64, 256, 32, 64


@dataclass
class Trace:
    """One request's life: scheduled arrival and what the client saw, seconds from run start."""

    arrival: float
    first_text: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class RoundResult:
    target: str
    cache: str
    requests: int
    arrivals: str
    slo_s: float
    wall_s: float
    tok_s: float
    goodput_rps: float
    ttft_p50: float | None
    e2e_p50: float
    e2e_p95: float
    e2e_p99: float
    failed: int
    gpu_util: float | None = None
    pct_peak: float | None = None
    x_all: float | None = None
    extra: dict = field(default_factory=dict)


# ---- arrival processes -------------------------------------------------------------------
def arrival_times(
    spec: str, n: int, saturated_rps: float | None, rng: random.Random
) -> list[float]:
    """Seconds from the start at which each of n requests arrives."""
    kind, *args = spec.split(":")
    if kind == "all":
        return [0.0] * n
    if kind == "gap":
        return [i * float(args[0]) / 1e3 for i in range(n)]
    if kind == "burst":
        size, gap = int(args[0]), float(args[1]) / 1e3
        return [(i // size) * gap for i in range(n)]
    if kind == "poisson":
        if not saturated_rps:
            raise ValueError("poisson arrivals need the saturated rate: put 'all' first")
        rate = float(args[0]) * saturated_rps
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(rate)
        return out
    raise ValueError(f"unknown arrival spec {spec!r}")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summarise(traces: list[Trace], wall: float, slo: float) -> dict:
    ok = [t for t in traces if t.done is not None and t.error is None]
    e2e = [t.done - t.arrival for t in ok]
    ttft = [t.first_text - t.arrival for t in ok if t.first_text is not None]
    met = sum(1 for x in e2e if x <= slo)
    return {
        "wall_s": wall,
        "tok_s": sum(t.tokens for t in ok) / wall if wall else 0.0,
        "goodput_rps": met / wall if wall else 0.0,
        "ttft_p50": statistics.median(ttft) if ttft else None,
        "e2e_p50": percentile(e2e, 50) if e2e else float("nan"),
        "e2e_p95": percentile(e2e, 95) if e2e else float("nan"),
        "e2e_p99": percentile(e2e, 99) if e2e else float("nan"),
        "failed": len(traces) - len(ok),
    }


# ---- GPU utilisation ---------------------------------------------------------------------
class GpuSampler:
    """Mean GPU utilisation over a round from nvidia-smi (None where there is none)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
                + ["-lms", "100"],
                stdout=subprocess.PIPE,
                text=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            vals = [float(x) for x in out.split() if x.strip().replace(".", "").isdigit()]
            self.mean = statistics.mean(vals) if vals else None
        else:
            self.mean = None


# ---- targets -----------------------------------------------------------------------------
def drive_engine(
    engine,
    prompts: list[list[int]],
    params: dict,
    arrivals: list[float],
    steps: list[dict] | None = None,
):
    """Feed requests to the engine at their arrival times, stepping it in between. With
    `steps`, append each step's start, wall time, rows, packed tokens and graph captures
    (where a staggered round's time goes)."""
    runner = engine.runner
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    traces = [Trace(arrivals[i]) for i in range(len(prompts))]
    ids: dict[str, int] = {}
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            ids[engine.add_request(None, prompts[i], params)] = i
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[order[nxt]] - now))
            continue
        tokens0, captures0 = runner.work["tokens"], graph_captures(runner)
        outs = engine.step()
        after = time.perf_counter() - t0
        if steps is not None:
            steps.append(
                {
                    "t": round(now, 5),
                    "wall_ms": round((after - now) * 1e3, 3),
                    "rows": engine.last_step_rows,
                    "tokens": runner.work["tokens"] - tokens0,
                    "captures": graph_captures(runner) - captures0,
                }
            )
        now = after
        for o in outs:
            tr = traces[ids[o.request_id]]
            if o.delta_text and tr.first_text is None:
                tr.first_text = now
            if o.finished:
                tr.done = now
                tr.tokens = o.completion_tokens
                if tr.first_text is None:
                    tr.first_text = now
    return traces, time.perf_counter() - t0


def graph_captures(runner) -> int:
    """CUDA graphs the runner has captured so far (0 without graphs)."""
    return runner.graphs.captures if runner.graphs is not None else 0


def drive_threads(send: Callable[[int, Trace, float], None], n: int, arrivals: list[float]):
    """One thread per request: sleep until its arrival, then `send` it."""
    traces = [Trace(a) for a in arrivals]
    t0 = time.perf_counter()

    def worker(i: int) -> None:
        time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        try:
            send(i, traces[i], t0)
        except Exception as exc:  # counted as a failed request in the round
            traces[i].error = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    return traces, time.perf_counter() - t0


def triton_sender(url: str, model: str, prompts, messages, params: dict):
    """Token ids when the workload has them (random weights), chat messages otherwise."""
    from dlm_client import DLMClient

    client = DLMClient(url, model)

    def send(i: int, tr: Trace, t0: float) -> None:
        request = {"input_ids": prompts[i]} if prompts else {"messages": messages[i]}
        for chunk in client.stream(stream=True, **request, **params):
            now = time.perf_counter() - t0
            if chunk.text and tr.first_text is None:
                tr.first_text = now
            if chunk.final:
                tr.done, tr.tokens = now, chunk.completion_tokens

    return send


_HTTP = None


def http_client():
    """One HTTP client for every request thread: creating one per request costs tens of ms of
    CPU (it loads a CA bundle) under the GIL, which spread a burst of 32 "simultaneous" requests
    over a second before they left the benchmark process."""
    global _HTTP
    if _HTTP is None:
        import httpx

        _HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=None))
    return _HTTP


def proxy_sender(url: str, model: str, prompts, messages, params: dict):
    """Streamed completions of the workload's token ids when it has them (random weights: the
    very requests of the engine and Triton targets), streamed chat completions otherwise."""
    client = http_client()

    def send(i: int, tr: Trace, t0: float) -> None:
        if prompts is not None:
            body = {"model": model, "prompt": prompts[i], "stream": True, **params}
            route = "completions"
        else:
            body = {"model": model, "messages": messages[i], "stream": True, **params}
            route = "chat/completions"
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", f"{url}/v1/{route}", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                now = time.perf_counter() - t0
                choice = ev["choices"][0] if ev.get("choices") else {}
                if choice.get("text") or choice.get("delta", {}).get("content"):
                    tr.first_text = tr.first_text or now
                if ev.get("usage"):
                    tr.tokens = ev["usage"]["completion_tokens"]
        tr.done = time.perf_counter() - t0

    return send


# ---- main --------------------------------------------------------------------------------
def build_engine(args, max_rows: int):
    import torch

    from dlm_engine import Engine, EngineConfig

    if args.model.startswith("random:"):
        from dlm_engine.loader import random_checkpoint

        lm = random_checkpoint(args.model.split(":", 1)[1], "bfloat16", args.device, None)
        cfg = EngineConfig(
            model=args.model,
            device=args.device,
            max_rows=max_rows,
            max_canvas=CANVAS,
            max_step_tokens=1 << 30,
            **graph_limit(args),
        )
        return Engine(cfg, loaded=lm), torch
    from dlm_protocol.settings import ASSETS_DIR

    model = str(ASSETS_DIR / "tiny-dlm") if args.model == "tiny-dlm" else args.model
    cfg = EngineConfig(model=model, device=args.device, max_rows=max_rows, **graph_limit(args))
    return Engine(cfg), torch


def graph_limit(args) -> dict:
    """The engine's cuda_graph_max_tokens when --graph-max-tokens is given."""
    n = args.graph_max_tokens
    return {} if n is None else {"cuda_graph_max_tokens": n}


def workload(args, engine, n: int, rng: random.Random):
    """(token-id prompts, chat messages, request params) for n requests."""
    if args.model.startswith("random:"):
        prompts = [[rng.randrange(100000) for _ in range(PROMPT)] for _ in range(n)]
        params = dict(max_tokens=CANVAS, steps=STEPS, block_length=BLOCK)
        # the proxy takes chat messages: PROMPT random letters (the stand-in tokenizer is
        # character-level, so the prompt is PROMPT tokens plus the chat template's)
        letters = "abcdefghijklmnopqrstuvwxyz"
        msgs = [
            [{"role": "user", "content": "".join(rng.choice(letters) for _ in range(PROMPT))}]
            for _ in range(n)
        ]
        return prompts, msgs, params
    from dlm_lab.training.tasks import heldout_examples, messages_for

    msgs = [messages_for(ex) for ex in heldout_examples(n, seed=rng.randrange(1 << 30))]
    prompts = [engine.encode_prompt(messages=m) for m in msgs] if engine else None
    return prompts, msgs, dict(max_tokens=32, steps=32, block_length=8)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", choices=("engine", "triton", "proxy"), default="engine")
    ap.add_argument("--url", help="Triton gRPC host:port or proxy base URL")
    ap.add_argument(
        "--metrics-url",
        help="triton/proxy targets without --serve: Triton's metrics URL, to report the "
        "server engine's steps and rows a step per round (--serve knows it)",
    )
    ap.add_argument(
        "--serve",
        action="store_true",
        help="triton/proxy targets: start tritonserver (and the proxy) for --model on "
        "--device with the project launcher, and stop it by PID at the end",
    )
    ap.add_argument("--model", default="tiny-dlm", help="tiny-dlm, a directory, or random:NAME")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", default="8", help="comma list of N")
    ap.add_argument("--caches", default="none", help="comma list of none,prefix,dual")
    ap.add_argument("--arrivals", default="all,gap:100,poisson:0.8,burst:4:500")
    ap.add_argument(
        "--phase-waits",
        default="",
        help="comma list of the scheduler's phase_wait_steps to compare (engine target)",
    )
    ap.add_argument(
        "--warm-arrivals",
        action="store_true",
        help="run each arrival process once untimed first (a server that has captured its "
        "CUDA graphs for the shapes staggered arrivals produce, as a warmed-up one would)",
    )
    ap.add_argument(
        "--graph-max-tokens",
        type=int,
        default=None,
        help="the engine's cuda_graph_max_tokens (steps feeding whole sequences with more "
        "packed tokens run eagerly; 0 captures every shape); default: the engine's",
    )
    ap.add_argument(
        "--max-rows",
        type=int,
        default=0,
        help="the engine's rows per step (default: the largest N, so all of a round fit); "
        "below N, later requests queue, as on a loaded server",
    )
    ap.add_argument("--slo-factor", type=float, default=2.0, help="SLO = factor x e2e alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="traffic_out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = [int(x) for x in args.requests.split(",")]
    engine = torch = None
    peak = None
    if args.target == "engine":
        engine, torch = build_engine(args, args.max_rows or max(ns))
        if args.device.startswith("cuda"):
            sys.path.insert(0, str(Path(__file__).parent))
            from gpu_bench import bf16_peak_tflops

            peak = bf16_peak_tflops(torch.device(args.device))
    elif args.model.startswith("random:") and not args.serve:
        raise SystemExit("--target triton/proxy with random weights: add --serve")
    server = (
        start_server(args, args.max_rows or max(ns), out)
        if args.serve and args.target != "engine"
        else None
    )
    url, name, metrics_url = args.url, args.model, args.metrics_url
    if server is not None:  # what it serves
        url = server.urls["grpc"] if args.target == "triton" else server.urls["openai"]
        url, name = url.removesuffix("/v1"), server.model_name
        metrics_url = server.urls["metrics"]
        print(f"serving {args.model} as {name} at {url}", flush=True)
    served = Served(url, name, metrics_url)
    try:
        rows, header = run_settings(args, ns, engine, torch, peak, served)
    finally:
        if server is not None:
            server.stop()
    (out / "traffic.json").write_text(
        json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=2)
    )
    plot(rows, out / "traffic.png", header)


def start_server(args, max_rows: int, out: Path):
    """tritonserver (+ proxy) for --model through the project launcher, started."""
    from dlm_protocol.settings import ASSETS_DIR
    from dlm_triton.launch.launcher import Ports, TritonServerProcess

    random_weights = args.model.startswith("random:")
    model = ASSETS_DIR / "tiny-dlm" if args.model == "tiny-dlm" else args.model
    params = {"max_rows": str(max_rows)}
    if random_weights:
        params["max_canvas"] = str(CANVAS)
    params.update({k: str(v) for k, v in graph_limit(args).items()})
    server = TritonServerProcess(
        model,
        device=args.device,
        dtype="bfloat16" if random_weights else None,
        engine_params=params,
        ports=Ports.free(),
        proxy=args.target == "proxy",
        log_path=out / "tritonserver.log",
        ready_timeout_s=900,
        exit_timeout_s=20,
    )
    return server.start()


@dataclass
class Served:
    """Where the triton / proxy target is: its URL, model name and Triton's metrics URL."""

    url: str | None
    name: str
    metrics_url: str | None


def settled_scrape(metrics_url: str, quiet_s: float = 0.3, timeout_s: float = 10) -> dict:
    """The server's step metrics once they stopped changing: step figures are recorded just
    after the last final response (dlm_triton.backend.step_metrics), so a round's last steps may be
    missing from a scrape taken the moment its answers arrived."""
    from triton_gpu_bench import scrape

    deadline = time.monotonic() + timeout_s
    value = scrape(metrics_url)
    while True:
        time.sleep(quiet_s)
        again = scrape(metrics_url)
        if again == value or time.monotonic() > deadline:
            return again
        value = again


def served_steps(before: dict, after: dict) -> dict | None:
    """The server engine's steps and mean rows a step between two scrapes: whether a burst
    ran as one batch (N rows, the schedule's steps) or reached the engine in pieces."""
    if not before or not after:
        return None
    steps = after["dlm_rows_per_step_count"] - before["dlm_rows_per_step_count"]
    rows = after["dlm_rows_per_step_sum"] - before["dlm_rows_per_step_sum"]
    secs = after["dlm_step_duration_seconds_sum"] - before["dlm_step_duration_seconds_sum"]
    return {
        "steps": int(steps),
        "mean_rows": round(rows / steps, 2) if steps else 0,
        "stepping_s": round(secs, 3),
    }


def run_settings(args, ns: list[int], engine, torch, peak, served: Served):
    """Every (cache, N, phase wait) setting under every arrival process: rows and header."""
    sys.path.insert(0, str(Path(__file__).parent))
    from triton_gpu_bench import device_name

    header = (
        f"target={args.target} model={args.model} device={device_name(args.device)} "
        f"graph_max_tokens={args.graph_max_tokens} arrivals={args.arrivals} "
        f"slo=factor {args.slo_factor} x the request's latency alone"
    )
    print(header, flush=True)
    rows: list[RoundResult] = []
    rng = random.Random(args.seed)
    waits = [int(w) for w in args.phase_waits.split(",") if w] or [None]
    settings = [(c, n, w) for c in args.caches.split(",") for n in ns for w in waits]
    for cache, n, wait in settings:
        if wait is not None and engine is not None:
            engine.scheduler.phase_wait_steps = wait
        prompts, msgs, params = workload(args, engine, n, rng)
        params = dict(params, cache=cache)

        def run(arr: list[float], k: int = n, p=prompts, m=msgs, par=params, log=None):
            if args.target == "engine":
                return drive_engine(engine, p[:k], par, arr, log)
            url, name = served.url, served.name
            if args.target == "triton":
                return drive_threads(triton_sender(url, name, p, m, par), k, arr)
            return drive_threads(proxy_sender(url, name, p, m, par), k, arr)

        run([0.0] * n)  # warm-up: graph capture and compilation at these shapes
        run([0.0], 1)  # and at batch 1, so the SLO's reference run is warm
        alone, _ = run([0.0], 1)
        slo = args.slo_factor * (alone[0].done - alone[0].arrival)
        saturated = None
        base_tps = None
        for spec in args.arrivals.split(","):
            arr = arrival_times(spec, n, saturated, rng)
            if args.warm_arrivals and spec != "all":
                run(arr)  # untimed: capture graphs at the shapes these arrivals produce
            work0 = dict(engine.runner.work) if engine else None
            captures0 = graph_captures(engine.runner) if engine else None
            log: list[dict] | None = [] if engine is not None else None
            metrics_url = served.metrics_url if engine is None else None
            before = settled_scrape(metrics_url) if metrics_url else {}
            with GpuSampler() as gpu:
                traces, wall = run(arr, log=log)
            s = summarise(traces, wall, slo)
            row = RoundResult(args.target, cache, n, spec, slo, gpu_util=gpu.mean, **s)
            if log is not None:
                row.extra["steps"] = step_summary(log, wall)
                log_file = f"steps_{cache}_n{n}_w{wait}_{spec.replace(':', '-')}.json"
                (Path(args.out) / log_file).write_text(json.dumps(log))
            if metrics_url:
                row.extra["served_steps"] = served_steps(before, settled_scrape(metrics_url))
            row.extra["phase_wait_steps"] = engine.scheduler.phase_wait_steps if engine else None
            row.extra["graph_captures"] = (
                graph_captures(engine.runner) - captures0
                if engine and engine.runner.graphs
                else None
            )
            if spec == "all":
                saturated = n / wall
                base_tps = row.tok_s
            if base_tps:
                row.x_all = row.tok_s / base_tps
            if peak and work0 is not None:
                from gpu_bench import work_flops

                work = {k: engine.runner.work[k] - work0[k] for k in work0}
                row.pct_peak = 100 * work_flops(engine, work) / wall / 1e12 / peak
            rows.append(row)
            print(format_row(row), flush=True)
    return rows, header


def step_summary(log: list[dict], wall: float) -> dict:
    """Where an engine round's wall time went: steps by batch size, steps that captured a
    graph, and time with no step running (waiting for arrivals, the driver's own work)."""
    by_rows: dict[int, list[float]] = {}
    for e in log:
        by_rows.setdefault(e["rows"], []).append(e["wall_ms"])
    stepping = sum(e["wall_ms"] for e in log) / 1e3
    return {
        "steps": len(log),
        "stepping_s": round(stepping, 3),
        "outside_steps_s": round(wall - stepping, 3),
        "capture_steps_s": round(sum(e["wall_ms"] for e in log if e["captures"]) / 1e3, 3),
        "mean_rows": round(statistics.fmean(e["rows"] for e in log), 2) if log else 0,
        "ms_by_rows": {
            r: {"steps": len(w), "median_ms": round(statistics.median(w), 2)}
            for r, w in sorted(by_rows.items())
        },
    }


def format_row(r: RoundResult) -> str:
    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    return (
        f"{r.target:<7}{r.cache:<6}N={r.requests:<4}wait={r.extra.get('phase_wait_steps')!s:<5}"
        f"{r.arrivals:<13}"
        f"tok/s={r.tok_s:8.1f} x_all={f(r.x_all)} goodput={r.goodput_rps:6.2f}/s "
        f"(slo {r.slo_s:.2f}s) ttft50={f(r.ttft_p50, '.3f')} e2e p50/95/99="
        f"{r.e2e_p50:.3f}/{r.e2e_p95:.3f}/{r.e2e_p99:.3f} failed={r.failed} "
        f"gpu={f(r.gpu_util, '.0f')}% peak={f(r.pct_peak, '.1f')}% "
        f"captures={r.extra.get('graph_captures')}"
        + (
            f" steps={st['steps']} stepping={st['stepping_s']}s outside={st['outside_steps_s']}s"
            f" capturing={st['capture_steps_s']}s rows~{st['mean_rows']}"
            if (st := r.extra.get("steps"))
            else ""
        )
        + (
            f" server steps={sv['steps']} rows~{sv['mean_rows']} stepping={sv['stepping_s']}s"
            if (sv := r.extra.get("served_steps"))
            else ""
        )
    )


def plot(rows: list[RoundResult], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:  # e.g. the stub's environment on a GPU host: traffic.json is written
        print(f"matplotlib missing: no {path.name}", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.cache, r.requests) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for cache, n in groups:
        sel = [r for r in rows if r.cache == cache and r.requests == n]
        labels = [r.arrivals for r in sel]
        axes[0].plot(labels, [r.tok_s for r in sel], marker="o", label=f"{cache}, N={n}")
        axes[1].plot(labels, [r.e2e_p95 for r in sel], marker="o", label=f"{cache}, N={n}")
    axes[0].set_ylabel("tokens/s")
    axes[1].set_ylabel("end-to-end p95 (s)")
    for ax in axes:
        ax.set_xlabel("arrival process")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
