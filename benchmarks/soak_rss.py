"""Soak: the official ``openai`` client against ``dlm-triton serve`` (tiny-dlm) for a while,
sampling the memory (RSS) of the stub, tritonserver and the proxy.

Answers "does the stub's memory plateau?" with numbers: one CSV row per sample and a summary
(calls, failures, RSS at start / 5 min / end, growth in the last third)::

    python benchmarks/soak_rss.py --minutes 30 --concurrency 2 --out out/soak

Nothing here asserts (tests/reliability/test_soak.py runs a short one and checks for failures).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import threading
import time
from pathlib import Path

import openai

from dlm_triton.launch.launcher import Ports, TritonServerProcess

PROMPTS = [
    "What is {a} + {b}?",
    "Sort these numbers: {a}, {b}, 7, 19",
    "Reverse the word {w}.",
    "What is {a} * 3?",
]
WORDS = ["diffusion", "triton", "server", "memory", "stable", "canvas"]


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (0 when gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def worker(client: openai.OpenAI, model: str, stop: threading.Event, counts: dict) -> None:
    rng = random.Random(threading.get_ident())
    while not stop.is_set():
        prompt = rng.choice(PROMPTS).format(
            a=rng.randint(0, 9999), b=rng.randint(0, 9999), w=rng.choice(WORDS)
        )
        messages = [{"role": "user", "content": prompt}]
        try:
            if rng.random() < 0.5:
                stream = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=32, stream=True
                )
                for _ in stream:
                    pass
            else:
                client.chat.completions.create(model=model, messages=messages, max_tokens=32)
            counts["calls"] += 1
        except Exception as exc:  # counted, the soak goes on
            counts["failures"] += 1
            counts["last_error"] = f"{type(exc).__name__}: {exc}"[:300]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--model", default=None, help="checkpoint or repository name (tiny-dlm)")
    ap.add_argument("--out", type=Path, default=Path("out/soak"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    server = TritonServerProcess(
        args.model, device="cpu", ports=Ports.free(), proxy=True, log_path=args.out / "triton.log"
    )
    server.start()
    server.supervise()
    counts = {"calls": 0, "failures": 0, "last_error": ""}
    stop = threading.Event()
    client = openai.OpenAI(base_url=server.urls["openai"], api_key="unused", max_retries=0)
    threads = [
        threading.Thread(target=worker, args=(client, server.model_name, stop, counts))
        for _ in range(args.concurrency)
    ]
    rows: list[dict] = []
    t0 = time.monotonic()
    try:
        for t in threads:
            t.start()
        while time.monotonic() - t0 < args.minutes * 60:
            stubs = server.stub_pids()
            row = {
                "t_s": round(time.monotonic() - t0, 1),
                "calls": counts["calls"],
                "failures": counts["failures"],
                "stub_rss_mb": round(sum(rss_mb(p) for p in stubs), 1),
                "server_rss_mb": round(rss_mb(server.server.pid), 1) if server.server else 0,
                "proxy_rss_mb": round(rss_mb(server.proxy.pid), 1) if server.proxy else 0,
                "restarts": server.restarts,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(args.sample_s)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        server.stop()
    with open(args.out / "rss.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = summarize(rows, counts)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


def summarize(rows: list[dict], counts: dict) -> dict:
    """Stub RSS at the start, after 5 minutes and at the end; growth over the last third."""

    def at(seconds: float) -> float:
        return next(
            (r["stub_rss_mb"] for r in rows if r["t_s"] >= seconds), rows[-1]["stub_rss_mb"]
        )

    last_third = rows[len(rows) * 2 // 3 :]
    return {
        "minutes": round(rows[-1]["t_s"] / 60, 1),
        "calls": counts["calls"],
        "failures": counts["failures"],
        "last_error": counts["last_error"],
        "stub_rss_mb_start": rows[0]["stub_rss_mb"],
        "stub_rss_mb_5min": at(300),
        "stub_rss_mb_end": rows[-1]["stub_rss_mb"],
        "stub_rss_mb_max": max(r["stub_rss_mb"] for r in rows),
        "stub_growth_last_third_mb": round(
            last_third[-1]["stub_rss_mb"] - last_third[0]["stub_rss_mb"], 1
        ),
        "proxy_rss_mb_start": rows[0]["proxy_rss_mb"],
        "proxy_rss_mb_end": rows[-1]["proxy_rss_mb"],
        "restarts": rows[-1]["restarts"],
    }


if __name__ == "__main__":
    sys.exit(main())
