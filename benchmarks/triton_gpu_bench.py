"""The full serving path on the GPU: tritonserver + our Python model + gRPC streams.

Starts tritonserver through the project launcher (``TritonServerProcess``, the KIND_GPU config,
no proxy) on ``random:llada-8b`` (the published LLaDA-8B architecture with random bf16 weights,
built on the GPU, no download), then for each cache mode and concurrency sends all requests at
once, each on its own gRPC stream (``dlm_client.DLMClient`` over ``tritonclient.grpc``, one
thread per request). Settings match ``benchmarks/gpu_bench.py``: prompt of 64 random token ids,
canvas 256 (``max_tokens``), block 32, 64 steps, temperature 0, ``cache`` none (exact) or dual.
Random weights never produce end of text, so every request runs its full fixed schedule and the
time is honest.

Each setting gets one warm-up round first (same concurrency; CUDA graph capture and
torch.compile happen at first use of a shape), run with 2 steps per block like gpu_bench's
capture pass. Measured per setting: aggregate generated tok/s (sum of completion tokens / wall
time from the first send to the last final response), mean and max time per request, mean time
to first token (first streamed response), and from the server's metrics endpoint the mean rows
per engine step, the mean step time and the requests each instance finished during the round.

Data parallel (``--data-parallel-size 1,2``): one server per size, started and stopped in turn,
each placing that many engine replicas (one Triton instance per GPU, as ``dlm-triton serve
--data-parallel-size`` does; on the CPU that many CPU instances). ``--via triton,proxy`` times
each setting twice on the same server: over gRPC streams, and through the OpenAI proxy that the
launcher starts in front of it (streamed ``/v1/completions`` of the same token ids, one HTTP
stream per request), each path with its own warm-up round. ``scaling`` in results.json is each
size's tok/s over the first size's, per cache, concurrency and path; results.json is rewritten
after every round, so a run cut short keeps what it measured.

    python benchmarks/triton_gpu_bench.py --out triton_gpu_out
    python benchmarks/triton_gpu_bench.py --data-parallel-size 1,2 --via triton,proxy \\
        --concurrency 32 --caches dual --out dp_out          # a 2-GPU host
    python benchmarks/triton_gpu_bench.py --tiny --device cpu --prompt 8 --max-tokens 32 \\
        --block 8 --steps 8 --concurrency 1,4 --out /tmp/tb   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from dlm_triton.launch.launcher import Ports, TritonServerProcess

_METRIC_LINE = re.compile(r"^(\w+)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$")
_INSTANCE = re.compile(r'^dlm_requests_total\{[^}]*instance="([^"]+)"[^}]*\}\s+([-+0-9.eE]+)$')
_WATCHED = (
    "dlm_rows_per_step_sum",
    "dlm_rows_per_step_count",
    "dlm_step_duration_seconds_sum",
    "dlm_step_duration_seconds_count",
    "dlm_cuda_graph_captures_total",
)


def device_name(device: str) -> str:
    if device.startswith("cuda") and shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return f"cpu ({platform.processor() or platform.machine()})"


def gpu_memory_mib() -> list[int] | None:
    """Memory in use on each visible GPU (nvidia-smi), to show where the replicas went."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    return [int(float(x)) for x in out.stdout.split()]


def scrape(url: str) -> dict[str, float]:
    """Sums over labels of the engine metrics we watch (empty when unreachable)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    totals = dict.fromkeys(_WATCHED, 0.0)
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and m.group(1) in totals:
            totals[m.group(1)] += float(m.group(2))
    return totals


def tiny_checkpoint(root: Path) -> tuple[Path, list[int]]:
    """A tiny random LLaDA checkpoint and the ids of its plain single-character tokens."""
    from dlm_lab.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(root / "tiny-llada", "llada")
    vocab = json.loads((ckpt / "tokenizer.json").read_text())["model"]["vocab"]
    ids = sorted(i for tok, i in vocab.items() if len(tok) == 1 and tok.isalnum())
    return ckpt, ids


def requests_by_instance(url: str) -> dict[str, float]:
    """Finished requests per Triton instance (``dlm_requests_total`` summed over outcomes)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = _INSTANCE.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0.0) + float(m.group(2))
    return counts


Send = Callable[[list[int], dict, dict], None]


def grpc_sender(client) -> Send:
    """One request over its own gRPC stream (``dlm_client``); fills first/done/tokens."""

    def send(input_ids: list[int], sampling: dict, out: dict) -> None:
        chunks = 0
        for chunk in client.stream(input_ids=input_ids, stream=True, **sampling):
            chunks += 1
            if "first" not in out:
                out["first"] = time.perf_counter()
            if chunk.final:
                out["done"] = time.perf_counter()
                out["completion_tokens"] = chunk.completion_tokens
                out["steps"] = chunk.steps
                out["finish_reason"] = chunk.finish_reason
        out["chunks"] = chunks

    return send


def proxy_sender(http, base_url: str, model: str) -> Send:
    """One streamed ``/v1/completions`` of the token ids through the OpenAI proxy: first text
    chunk, end of stream, and the completion tokens of the usage chunk."""

    def send(input_ids: list[int], sampling: dict, out: dict) -> None:
        body = {"model": model, "prompt": input_ids, "stream": True, **sampling}
        body["stream_options"] = {"include_usage": True}
        chunks = 0
        with http.stream("POST", f"{base_url}/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode()[:300]}")
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                chunks += 1
                choice = event["choices"][0] if event.get("choices") else {}
                if "first" not in out and choice.get("text"):
                    out["first"] = time.perf_counter()
                if choice.get("finish_reason"):
                    out["finish_reason"] = choice["finish_reason"]
                if event.get("usage"):
                    out["completion_tokens"] = event["usage"]["completion_tokens"]
        if "completion_tokens" in out:
            out["done"] = time.perf_counter()
            out.setdefault("first", out["done"])
        out["chunks"] = chunks

    return send


def one_request(
    send: Send, input_ids: list[int], sampling: dict, barrier: threading.Barrier, out: dict
) -> None:
    """Send one streamed request after the barrier; record send, first and final times."""
    try:
        barrier.wait()
        out["sent"] = time.perf_counter()
        send(input_ids, sampling, out)
    except Exception as exc:  # reported per request; the round is marked failed
        out["error"] = f"{type(exc).__name__}: {exc}"


def run_round(
    send: Send, prompts: list[list[int]], sampling: dict, metrics_url: str, timeout_s: float
) -> dict:
    """All requests at once, one stream each; aggregate and per-request times."""
    n = len(prompts)
    barrier = threading.Barrier(n)
    results: list[dict] = [{} for _ in range(n)]
    threads = [
        threading.Thread(target=one_request, args=(send, p, sampling, barrier, r), daemon=True)
        for p, r in zip(prompts, results, strict=True)
    ]
    before = scrape(metrics_url)
    by_instance = requests_by_instance(metrics_url)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    after = scrape(metrics_url)
    by_instance_after = requests_by_instance(metrics_url)
    errors = [r.get("error", "no final response") for r in results if "done" not in r]
    if errors:
        return {"ok": False, "errors": errors[:3], "failed": len(errors)}
    start = min(r["sent"] for r in results)
    end = max(r["done"] for r in results)
    wall = end - start
    tokens = sum(r["completion_tokens"] for r in results)
    e2e = [r["done"] - r["sent"] for r in results]
    ttft = [r["first"] - r["sent"] for r in results]
    row = {
        "ok": True,
        "requests": n,
        "wall_s": wall,
        "completion_tokens": tokens,
        "tok_s": tokens / wall,
        "mean_request_s": sum(e2e) / n,
        "max_request_s": max(e2e),
        "mean_ttft_s": sum(ttft) / n,
        "max_ttft_s": max(ttft),
        "steps_per_request": sorted({r["steps"] for r in results if "steps" in r}),
        "tokens_per_request": sorted({r["completion_tokens"] for r in results}),
        "finish_reasons": sorted({str(r.get("finish_reason")) for r in results}),
        "chunks_per_request": sum(r["chunks"] for r in results) / n,
    }
    if before and after:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _WATCHED}
        steps = d["dlm_rows_per_step_count"]
        row["engine_steps"] = int(steps)
        row["mean_rows_per_step"] = d["dlm_rows_per_step_sum"] / steps if steps else None
        ss = d["dlm_step_duration_seconds_count"]
        row["mean_step_ms"] = 1e3 * d["dlm_step_duration_seconds_sum"] / ss if ss else None
        # graphs captured inside the measured round: each is an eager forward plus a capture
        row["graph_captures"] = int(d["dlm_cuda_graph_captures_total"])
    if by_instance_after:  # the last responses may be counted just after the client saw them
        row["requests_by_instance"] = {
            k: int(v - by_instance.get(k, 0.0)) for k, v in sorted(by_instance_after.items())
        }
    return row


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt("terminated")


def scaling(rows: list[dict]) -> list[dict]:
    """Each data-parallel size's tok/s over the first size's, per cache, streams and path."""
    ok = [r for r in rows if r.get("ok")]
    if not ok:
        return []
    first = ok[0]["data_parallel_size"]

    def key(r: dict) -> tuple:
        return r["cache"], r["concurrency"], r["via"]

    base = {key(r): r["tok_s"] for r in ok if r["data_parallel_size"] == first}
    return [
        {
            "cache": r["cache"],
            "concurrency": r["concurrency"],
            "via": r["via"],
            "data_parallel_size": r["data_parallel_size"],
            "versus": first,
            "speedup": r["tok_s"] / base[key(r)],
        }
        for r in ok
        if r["data_parallel_size"] != first and key(r) in base
    ]


def print_row(row: dict, max_tokens: int) -> None:
    head = (
        f"{row['data_parallel_size']!s:>3} {row['via']:<7}{row['cache']:<7}{row['concurrency']:>8}"
    )
    if not row["ok"]:
        print(f"{head}  FAILED ({row.get('stage', 'round')}): {row['errors']}", flush=True)
        return
    rows_ps = row.get("mean_rows_per_step")
    step_ms = row.get("mean_step_ms")
    print(
        f"{head}{row['tok_s']:>9.0f}{row['mean_request_s']:>8.2f}{row['mean_ttft_s']:>8.2f}"
        f"{(f'{rows_ps:.1f}' if rows_ps else '-'):>10}"
        f"{(f'{step_ms:.1f}' if step_ms else '-'):>9}"
        f"{row['wall_s']:>8.2f}  {row['warmup_s']:.1f}  "
        f"{list(row.get('requests_by_instance', {}).values())}  "
        f"captures {row.get('graph_captures', '-')}",
        flush=True,
    )
    if row["tokens_per_request"] != [max_tokens]:
        print(f"  note: tokens per request {row['tokens_per_request']} "
              f"({row['finish_reasons']}), steps {row['steps_per_request']}",
              flush=True)  # fmt: skip


def serve_phase(args, model, dtype, dp: int | None, out: Path, results: dict, phase: dict) -> None:
    """One server (``dp`` replicas, the proxy in front where asked): every cache x concurrency
    x path, each with its warm-up round; rows appended to ``results`` and saved as they come."""
    from dlm_client import DLMClient

    vias = args.via.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    tag = "default" if dp is None else str(dp)
    server = TritonServerProcess(
        model,
        device=args.device,
        dtype=dtype,
        engine_params={
            "max_rows": str(results["settings"]["max_rows"]),
            "max_canvas": str(args.max_tokens),
        },  # fmt: skip
        ports=Ports.free(),
        proxy="proxy" in vias,
        log_path=out / f"tritonserver_dp{tag}.log",
        ready_timeout_s=args.ready_timeout,
        exit_timeout_s=20,
        data_parallel_size=dp,
    )
    http = None
    t0 = time.perf_counter()
    try:
        server.start()
        phase["load_s"] = time.perf_counter() - t0
        phase["placement"] = server.placement
        phase["pids"] = {
            "tritonserver": server.server.pid if server.server else None,
            "proxy": server.proxy.pid if server.proxy else None,
            "stubs": server.stub_pids(),
        }
        phase["gpu_memory_mib_loaded"] = gpu_memory_mib() if args.device != "cpu" else None
        print(f"dp={tag}: server ready in {phase['load_s']:.0f}s: {server.model_name} "
              f"{server.urls['grpc']} placement {server.placement or 'config default'}, "
              f"{len(phase['pids']['stubs'])} stubs ({server.dist.source if server.dist else '?'} "
              f"tritonserver)", flush=True)  # fmt: skip
        client = DLMClient(
            server.urls["grpc"],
            server.model_name,
            http_url=server.urls["http"],
            timeout_s=args.round_timeout,
        )
        senders: dict[str, Send] = {"triton": grpc_sender(client)}
        if "proxy" in vias:
            import httpx

            http = httpx.Client(
                timeout=args.round_timeout, limits=httpx.Limits(max_connections=None)
            )
            senders["proxy"] = proxy_sender(http, server.urls["openai"], server.model_name)
        prompts = results["prompts"]
        for cache in args.caches.split(","):
            for n in concurrency:
                sampling = {
                    "max_tokens": args.max_tokens,
                    "steps": args.steps,
                    "block_length": args.block,
                    "temperature": 0.0,
                    "cache": cache,
                }
                warm_sampling = dict(sampling, steps=results["settings"]["warmup_steps"])
                for via in vias:
                    send = senders[via]
                    row = {"data_parallel_size": dp, "via": via, "cache": cache, "concurrency": n}
                    tw = time.perf_counter()
                    for _ in range(args.warmups):
                        warm = run_round(
                            send, prompts[:n], warm_sampling, server.urls["metrics"],
                            args.round_timeout,
                        )  # fmt: skip
                        if not warm["ok"]:
                            row.update(ok=False, errors=warm["errors"], stage="warm-up")
                            break
                    row["warmup_s"] = time.perf_counter() - tw
                    if "ok" not in row:
                        row.update(
                            run_round(
                                send,
                                prompts[:n],
                                sampling,
                                server.urls["metrics"],
                                args.round_timeout,
                            )  # fmt: skip
                        )
                    results["rows"].append(row)
                    results["scaling"] = scaling(results["rows"])
                    save(out, results)
                    print_row(row, args.max_tokens)
        if args.device != "cpu":
            phase["gpu_memory_mib_after"] = gpu_memory_mib()
            print(f"dp={tag}: GPU memory MiB loaded {phase['gpu_memory_mib_loaded']}, after "
                  f"the rounds {phase['gpu_memory_mib_after']}", flush=True)  # fmt: skip
    finally:
        if http is not None:
            http.close()
        server.stop()
        phase["stop"] = server.last_stop
        save(out, results)
        print(f"dp={tag}: server stopped: {json.dumps(server.last_stop)}", flush=True)


def save(out: Path, results: dict) -> None:
    public = {k: v for k, v in results.items() if k != "prompts"}
    (out / "results.json").write_text(json.dumps(public, indent=2))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="triton_gpu_out", help="folder for results.json and logs")
    ap.add_argument("--model", default="random:llada-8b")
    ap.add_argument("--tiny", action="store_true", help="serve a tiny random checkpoint instead")
    ap.add_argument("--device", default="cuda", help="cuda (KIND_GPU config) or cpu")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--caches", default="dual,none", help="cache modes, in this order")
    ap.add_argument(
        "--data-parallel-size",
        default="",
        help="comma list of engine replicas per server, one server each in turn (e.g. 1,2); "
        "default: the launcher's (on GPUs the config's: one instance per visible GPU)",
    )
    ap.add_argument(
        "--via",
        default="triton",
        help="comma list of paths: triton (gRPC streams) and/or proxy (streamed completions "
        "through the OpenAI proxy, started in front of the same server)",
    )
    ap.add_argument("--warmups", type=int, default=1, help="warm-up rounds per setting and path")
    ap.add_argument("--prompt", type=int, default=64, help="prompt length (random token ids)")
    ap.add_argument("--id-max", type=int, default=100000, help="prompt ids are < this")
    ap.add_argument("--max-tokens", type=int, default=256, help="canvas")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-rows", type=int, default=0, help="engine rows (default: max conc.)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--round-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vias = args.via.split(",")
    if not vias or set(vias) - {"triton", "proxy"}:
        ap.error(f"--via {args.via!r}: a comma list of triton and proxy")
    try:
        sizes: list[int | None] = [int(d) for d in args.data_parallel_size.split(",") if d]
    except ValueError:
        ap.error(f"--data-parallel-size {args.data_parallel_size!r}: a comma list of integers")
    if any(d < 1 for d in sizes):
        ap.error("--data-parallel-size: each size must be at least 1")
    sizes = sizes or [None]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    max_rows = args.max_rows or max(concurrency)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="triton-gpu-bench-"))
    model: str | Path = args.model
    id_pool: list[int] | None = None
    dtype: str | None = args.dtype
    if args.tiny:
        model, id_pool = tiny_checkpoint(tmp)
        dtype = None  # the checkpoint's own
    prompts = [
        [rng.choice(id_pool) if id_pool else rng.randrange(args.id_max) for _ in range(args.prompt)]
        for _ in range(max(concurrency))
    ]
    settings = {
        "model": str(args.model if not args.tiny else "tiny random llada checkpoint"),
        "prompt_tokens": args.prompt,
        "max_tokens": args.max_tokens,
        "block_length": args.block,
        "steps": args.steps,
        "temperature": 0.0,
        "max_rows": max_rows,
        "dtype": dtype or "checkpoint",
        "streamed": True,
        "warmup_steps": 2 * (args.max_tokens // args.block),
        "warmups": args.warmups,
        "data_parallel_sizes": sizes,
        "via": vias,
    }
    device = device_name(args.device)
    header = (
        f"device={device} python={platform.python_version()} via tritonserver (launcher, "
        f"{'KIND_GPU' if args.device.startswith('cuda') else 'KIND_CPU'}), "
        f"{' and '.join('gRPC streams' if v == 'triton' else 'the OpenAI proxy' for v in vias)}"
        f", one stream per request; data parallel {sizes}\n{settings['model']}: random weights, "
        f"fixed schedules (no early stop); prompt {args.prompt} random ids, canvas "
        f"{args.max_tokens}, block {args.block}, {args.steps} steps, temperature 0, engine "
        f"max_rows {max_rows} per replica"
    )
    print(header, flush=True)
    results: dict = {
        "header": header,
        "device": device,
        "settings": settings,
        "rows": [],
        "phases": [],
        "scaling": [],
        "prompts": prompts,
    }
    code = 0
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` / a stop: still stop the server
    print(f"{'dp':>3} {'via':<7}{'cache':<7}{'streams':>8}{'tok/s':>9}{'req s':>8}{'TTFT s':>8}"
          f"{'rows/step':>10}{'step ms':>9}{'wall s':>8}  warm-up s  requests by instance",
          flush=True)  # fmt: skip
    try:
        for dp in sizes:
            phase: dict = {"data_parallel_size": dp}
            results["phases"].append(phase)
            try:
                serve_phase(args, model, dtype, dp, out, results, phase)
            except Exception as exc:  # this size failed (its server is stopped): next size
                code = 1
                phase["error"] = f"{type(exc).__name__}: {exc}"
                print(f"dp={dp}: FAILED: {phase['error']}", file=sys.stderr, flush=True)
    except KeyboardInterrupt as exc:
        code = 1
        results["error"] = f"{type(exc).__name__}: {exc}"
        print(f"FAILED: {results['error']}", file=sys.stderr, flush=True)
    finally:
        save(out, results)
        shutil.rmtree(tmp, ignore_errors=True)
    if any(not r["ok"] for r in results["rows"]):
        code = 1
    for s in results["scaling"]:
        print(f"dp {s['data_parallel_size']} / dp {s['versus']}, {s['via']}, {s['cache']}, "
              f"{s['concurrency']} streams: {s['speedup']:.2f}x", flush=True)  # fmt: skip
    print(f"results: {out / 'results.json'}", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
