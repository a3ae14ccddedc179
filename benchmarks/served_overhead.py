"""What serving adds to one request on CPU, over the in-process engine.

    python benchmarks/served_overhead.py [--runs 40] [--max-tokens 8] [--out results.json]

Starts the embedded tiny-dlm as `make serve` serves it (tritonserver and the OpenAI proxy on
free ports, stopped by PID at the end) and loads the same model in this process. Each round
runs one short request (the README question, `--max-tokens` tokens in as many steps) three
ways in turn: in-process (chat template, tokenization, steps, detokenization, as the stub does
them), through Triton gRPC (`dlm_client`, not streamed) and through the proxy
(`/v1/chat/completions`, not streamed). A round's overhead is its served latency minus its own
in-process latency, and the median over rounds is reported, so drift of the machine between
rounds cancels out; a short request keeps the steps' own noise (a few ms a step here) small
against the overhead measured. Then `--runs` requests back to back through each served target
on one connection, as a client calling in a loop sends them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from dlm_client import DLMClient
from readme_chat import MESSAGES, MODEL, cpu_description, embedded_server

from dlm_engine import Engine, EngineConfig
from dlm_protocol.settings import ASSETS_DIR


def in_process(engine: Engine, params: dict) -> tuple[float, str]:
    """One request to the end in this process: seconds and its text."""
    t0 = time.perf_counter()
    prompt = engine.encode_prompt(messages=MESSAGES)
    engine.add_request(None, prompt, params)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                text = out.text
    return time.perf_counter() - t0, text


def timed(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def summary(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1e3 for v in values)
    return {
        "median_ms": round(statistics.median(ms), 2),
        "p10_ms": round(ms[len(ms) // 10], 2),
        "p90_ms": round(ms[(len(ms) * 9) // 10], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = ap.parse_args()
    params = {"max_tokens": args.max_tokens, "steps": args.max_tokens}
    engine = Engine(EngineConfig(model=str(ASSETS_DIR / MODEL), device="cpu"))
    lat: dict[str, list[float]] = {"engine": [], "triton": [], "proxy": []}
    texts: dict[str, str] = {}
    first: dict[str, list[bool]] = {"triton": [], "proxy": []}  # per round: went first?
    with embedded_server() as server, httpx.Client() as http:
        client = DLMClient(server.urls["grpc"], model=MODEL)
        url = server.urls["openai"] + "/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES, **params}

        def via_triton() -> str:
            return client.generate(messages=MESSAGES, **params).text

        def via_proxy() -> str:
            r = http.post(url, json=body, timeout=60)
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        served = {"triton": via_triton, "proxy": via_proxy}
        for i in range(args.warmup + args.runs):
            seconds, texts["engine"] = in_process(engine, params)
            # the served targets take turns at going first: the one right after the in-process
            # request shares the two cores with this process's intra-op threads as they wind
            # down, which slows it (docs/benchmarks.md)
            order = ("triton", "proxy") if i % 2 == 0 else ("proxy", "triton")
            took = {}
            for target in order:
                t0 = time.perf_counter()
                texts[target] = served[target]()
                took[target] = time.perf_counter() - t0
            if i >= args.warmup:
                lat["engine"].append(seconds)
                for target in order:
                    lat[target].append(took[target])
                    first[target].append(target == order[0])
        # The same request back to back on one connection, as a script calling in a loop does
        # (the proxy's Nagle delay showed only there, docs/benchmarks.md): each target's
        # median against the in-process median of the rounds above.
        calls = {
            "triton": lambda: client.generate(messages=MESSAGES, **params),
            "proxy": lambda: http.post(url, json=body, timeout=60).raise_for_status(),
        }
        in_a_row = {
            target: [timed(call) for _ in range(args.runs)] for target, call in calls.items()
        }
    overhead = {
        target: summary([s - e for s, e in zip(lat[target], lat["engine"], strict=True)])
        for target in ("triton", "proxy")
    }
    by_position = {
        target: {
            position: summary(
                [
                    s - e
                    for s, e, f in zip(lat[target], lat["engine"], first[target], strict=True)
                    if f == (position == "first")
                ]
            )
            for position in ("first", "second")
        }
        for target in ("triton", "proxy")
    }
    engine_median = statistics.median(lat["engine"])
    back_to_back = {
        target: summary([s - engine_median for s in values]) for target, values in in_a_row.items()
    }
    result = {
        "cpu": cpu_description(),
        "params": params,
        "texts": texts,
        "latency": {k: summary(v) for k, v in lat.items()},
        "overhead_vs_engine": overhead,
        "overhead_by_position": by_position,
        "back_to_back_minus_engine_median": back_to_back,
    }
    print(json.dumps(result["cpu"]))
    print(f"texts: {texts}")
    for k, v in result["latency"].items():
        print(f"{k:<7} latency median {v['median_ms']} ms (p10 {v['p10_ms']}, p90 {v['p90_ms']})")
    for k, v in overhead.items():
        print(
            f"{k:<7} minus engine, per round: median {v['median_ms']} ms "
            f"(p10 {v['p10_ms']}, p90 {v['p90_ms']}; goal <= 5)"
        )
    for k, v in by_position.items():
        print(
            f"{k:<7} minus engine, going first / second: median {v['first']['median_ms']} / "
            f"{v['second']['median_ms']} ms"
        )
    for k, v in back_to_back.items():
        print(
            f"{k:<7} back to back, minus the engine's median: median {v['median_ms']} ms "
            f"(p10 {v['p10_ms']}, p90 {v['p90_ms']})"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
