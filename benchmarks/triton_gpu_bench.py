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
per engine step and the mean step time during the round.

    python benchmarks/triton_gpu_bench.py --out triton_gpu_out
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
from pathlib import Path

from dlm_triton.launch.launcher import Ports, TritonServerProcess

_METRIC_LINE = re.compile(r"^(\w+)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$")
_WATCHED = (
    "dlm_rows_per_step_sum",
    "dlm_rows_per_step_count",
    "dlm_step_duration_seconds_sum",
    "dlm_step_duration_seconds_count",
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


def one_request(
    client, input_ids: list[int], sampling: dict, barrier: threading.Barrier, out: dict
) -> None:
    """Send one streamed request after the barrier; record send, first and final times."""
    try:
        barrier.wait()
        out["sent"] = time.perf_counter()
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
    except Exception as exc:  # reported per request; the round is marked failed
        out["error"] = f"{type(exc).__name__}: {exc}"


def run_round(
    client, prompts: list[list[int]], sampling: dict, metrics_url: str, timeout_s: float
) -> dict:
    """All requests at once, one gRPC stream each; aggregate and per-request times."""
    n = len(prompts)
    barrier = threading.Barrier(n)
    results: list[dict] = [{} for _ in range(n)]
    threads = [
        threading.Thread(target=one_request, args=(client, p, sampling, barrier, r), daemon=True)
        for p, r in zip(prompts, results, strict=True)
    ]
    before = scrape(metrics_url)
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    after = scrape(metrics_url)
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
        "steps_per_request": sorted({r["steps"] for r in results}),
        "tokens_per_request": sorted({r["completion_tokens"] for r in results}),
        "finish_reasons": sorted({r["finish_reason"] for r in results}),
        "chunks_per_request": sum(r["chunks"] for r in results) / n,
    }
    if before and after:
        d = {k: after[k] - before[k] for k in _WATCHED}
        steps = d["dlm_rows_per_step_count"]
        row["engine_steps"] = int(steps)
        row["mean_rows_per_step"] = d["dlm_rows_per_step_sum"] / steps if steps else None
        ss = d["dlm_step_duration_seconds_count"]
        row["mean_step_ms"] = 1e3 * d["dlm_step_duration_seconds_sum"] / ss if ss else None
    return row


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt("terminated")


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

    from dlm_client import DLMClient

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    caches = args.caches.split(",")
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
    }
    device = device_name(args.device)
    header = (
        f"device={device} python={platform.python_version()} via tritonserver (launcher, "
        f"{'KIND_GPU' if args.device.startswith('cuda') else 'KIND_CPU'}), gRPC streams, one per "
        f"request\n{settings['model']}: random weights, fixed schedules (no early stop); prompt "
        f"{args.prompt} random ids, canvas {args.max_tokens}, block {args.block}, "
        f"{args.steps} steps, temperature 0, engine max_rows {max_rows}"
    )
    print(header, flush=True)
    results: dict = {"header": header, "device": device, "settings": settings, "rows": []}

    def save() -> None:
        (out / "results.json").write_text(json.dumps(results, indent=2))

    server = TritonServerProcess(
        model,
        device=args.device,
        dtype=dtype,
        engine_params={"max_rows": str(max_rows), "max_canvas": str(args.max_tokens)},
        ports=Ports.free(),
        proxy=False,
        log_path=out / "tritonserver.log",
        ready_timeout_s=args.ready_timeout,
        exit_timeout_s=20,
    )
    code = 0
    t0 = time.perf_counter()
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` / a stop: still stop the server
    try:
        server.start()
        results["load_s"] = time.perf_counter() - t0
        print(f"server ready in {results['load_s']:.0f}s: {server.model_name} "
              f"{server.urls['grpc']} ({server.dist.source if server.dist else '?'} "
              f"tritonserver)", flush=True)  # fmt: skip
        client = DLMClient(
            server.urls["grpc"],
            server.model_name,
            http_url=server.urls["http"],
            timeout_s=args.round_timeout,
        )
        metrics_url = server.urls["metrics"]
        print(f"{'cache':<7}{'streams':>8}{'tok/s':>9}{'req s':>8}{'TTFT s':>8}"
              f"{'rows/step':>10}{'step ms':>9}{'wall s':>8}  warm-up s", flush=True)  # fmt: skip
        for cache in caches:
            for n in concurrency:
                sampling = {
                    "max_tokens": args.max_tokens,
                    "steps": args.steps,
                    "block_length": args.block,
                    "temperature": 0.0,
                    "cache": cache,
                }
                tw = time.perf_counter()
                warm = run_round(
                    client,
                    prompts[:n],
                    dict(sampling, steps=settings["warmup_steps"]),
                    metrics_url,
                    args.round_timeout,
                )
                warm_s = time.perf_counter() - tw
                row = {"cache": cache, "concurrency": n, "warmup_s": warm_s}
                if not warm["ok"]:
                    row.update(ok=False, errors=warm["errors"], stage="warm-up")
                else:
                    row.update(
                        run_round(client, prompts[:n], sampling, metrics_url, args.round_timeout)
                    )
                results["rows"].append(row)
                save()
                if not row["ok"]:
                    code = 1
                    print(f"{cache:<7}{n:>8}  FAILED: {row['errors']}", flush=True)
                    continue
                rows_ps = row.get("mean_rows_per_step")
                step_ms = row.get("mean_step_ms")
                print(
                    f"{cache:<7}{n:>8}{row['tok_s']:>9.0f}{row['mean_request_s']:>8.2f}"
                    f"{row['mean_ttft_s']:>8.2f}"
                    f"{(f'{rows_ps:.1f}' if rows_ps else '-'):>10}"
                    f"{(f'{step_ms:.1f}' if step_ms else '-'):>9}"
                    f"{row['wall_s']:>8.2f}  {warm_s:.1f}",
                    flush=True,
                )
                if row["tokens_per_request"] != [args.max_tokens]:
                    print(f"  note: tokens per request {row['tokens_per_request']} "
                          f"({row['finish_reasons']}), steps {row['steps_per_request']}",
                          flush=True)  # fmt: skip
    except (Exception, KeyboardInterrupt) as exc:
        code = 1
        results["error"] = f"{type(exc).__name__}: {exc}"
        print(f"FAILED: {results['error']}", file=sys.stderr, flush=True)
    finally:
        server.stop()
        results["stop"] = server.last_stop
        save()
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"server stopped: {json.dumps(server.last_stop)}", flush=True)
    print(f"results: {out / 'results.json'}", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
