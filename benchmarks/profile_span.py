"""Where a cached in-block step's time goes at batch 1 (dual cache, in-block; the target and the
figures are in docs/benchmarks.md). Prints the step's wall time, the device's busy time per step
(sum of kernel times from the profiler), the host time per step, the floor set by reading the
weights once at the measured memory bandwidth, and the kernels that take the device time.

    python benchmarks/profile_span.py --model llada-8b --out OUT_DIR
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import torch
from gpu_bench import shrink_presets
from gpu_bench_block import copy_bandwidth

from dlm_engine import Engine, EngineConfig
from dlm_engine.loader import random_checkpoint

PROMPT, CANVAS, BLOCK, STEPS = 64, 256, 32, 64


def in_block_steps(engine: Engine, prompt: list[int], params: dict) -> list[float]:
    """Run one request; wall seconds of each in-block (span) step. No synchronisation
    between steps (one before the request): a step may leave the next step's forward running
    on the device (dlm_engine/lookahead.py), so back-to-back walls are what a served stream
    sees; each step ends with its copy, so without a forward ahead the device is idle at each
    step's start either way."""
    r = engine.runner
    engine.add_request(None, prompt, params)
    walls: list[float] = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    while engine.has_unfinished():
        before = r.span_steps
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if r.span_steps > before:
            walls.append(dt)
    return walls


def host_phases(engine: Engine, prompt: list[int], params: dict) -> dict[str, float]:
    """Median ms per in-block step of the host's stretches: the engine's own work before the
    runner plans (admission, queries), the packed plan (index tensors and their copies, or the
    last step's plan over new tokens), from
    the plan to the graph's replay (static-input copies), the replay call itself, from there to
    the runner's one device-to-host copy returning (decoding kernels queued, then the wait for
    the device), and after the copy (outputs, detokenization). The device idles through the
    stretches before the replay and after the copy."""
    import dlm_engine.model_runner as model_runner

    r = engine.runner
    marks: dict[str, float] = {}
    run_step, plan, reuse = r.step, model_runner.plan_packed, model_runner.with_new_tokens
    replay = torch.cuda.CUDAGraph.replay

    def timed_step(seqs, **kwargs):
        out = run_step(seqs, **kwargs)
        marks["copied"] = time.perf_counter()
        return out

    def timed(make):  # a new plan, or the last one over new tokens (`with_new_tokens`)
        def planned(*a, **k):
            marks["plan0"] = time.perf_counter()
            out = make(*a, **k)
            marks["plan1"] = time.perf_counter()
            return out

        return planned

    def timed_replay(graph):
        marks["replay0"] = time.perf_counter()
        replay(graph)
        marks["replay1"] = time.perf_counter()

    r.step, model_runner.plan_packed = timed_step, timed(plan)
    model_runner.with_new_tokens = timed(reuse)
    torch.cuda.CUDAGraph.replay = timed_replay
    engine.add_request("phased", prompt, params)
    stretches = ("engine", "plan", "to_replay", "replay", "to_copy", "after_copy")
    phases: dict[str, list[float]] = {k: [] for k in stretches}
    try:
        while engine.has_unfinished():
            before = r.span_steps
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks.clear()
            t = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            if r.span_steps > before and {"copied", "plan0"} <= marks.keys():
                r0 = marks.get("replay0", marks["plan1"])
                r1 = marks.get("replay1", r0)
                edges = (t, marks["plan0"], marks["plan1"], r0, r1, marks["copied"], end)
                for name, a, b in zip(stretches, edges, edges[1:], strict=False):
                    phases[name].append(b - a)
    finally:
        del r.step
        model_runner.plan_packed, model_runner.with_new_tokens = plan, reuse
        torch.cuda.CUDAGraph.replay = replay
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in phases.items() if v}


def host_profile(engine: Engine, prompt: list[int], params: dict, top: int = 25) -> list:
    """cProfile of the in-block steps of one request: (function, cumulative ms per step)."""
    r = engine.runner
    engine.add_request("host-profiled", prompt, params)
    prof, n = cProfile.Profile(), 0
    while engine.has_unfinished():
        before = r.span_steps
        prof.enable()
        engine.step()
        prof.disable()
        n += r.span_steps > before
    stats = pstats.Stats(prof).sort_stats("cumulative")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]  # type: ignore[attr-defined]
    return [
        (f"{Path(f).name}:{line}({fn})", round(v[3] / max(n, 1) * 1e3, 3))
        for (f, line, fn), v in rows
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--cache", default="dual")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="profile_span_out")
    ap.add_argument("--no-fused", action="store_true", help="engine without fused kernels")
    ap.add_argument("--tiny", action="store_true", help="shrunken preset: a CPU smoke run")
    ap.add_argument(
        "--no-lookahead", action="store_true", help="no forward queued ahead of the copy"
    )
    args = ap.parse_args()
    if args.tiny:
        shrink_presets()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    lm = random_checkpoint(args.model, "bfloat16", args.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    cfg = EngineConfig(model=f"random:{args.model}", device=args.device, max_rows=8,
                       max_canvas=CANVAS, fused_kernels=not args.no_fused)  # fmt: skip
    engine = Engine(cfg, loaded=lm)
    if args.no_lookahead:
        engine.runner.lookahead = False
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 30000, (PROMPT,), generator=gen).tolist()
    params = dict(max_tokens=CANVAS, steps=STEPS, block_length=BLOCK, cache=args.cache)
    in_block_steps(engine, prompt, params)  # graphs captured here
    walls = in_block_steps(engine, prompt, params)
    wall_ms = statistics.median(walls) * 1e3

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    # the device's work per step and the host's stretches are measured step by step, with no
    # forward queued ahead (else a profiled window holds one forward more than its steps, and
    # the host's stretches hide in the wait); the walls above are taken as configured
    r = engine.runner
    looking_ahead, r.lookahead = getattr(r, "lookahead", False), False
    engine.add_request("profiled", prompt, params)
    for _ in range(9):  # past the first block and into the second
        engine.step()
    n = 0
    with profile(activities=acts) as prof:
        while n < 6:
            before = r.span_steps
            engine.step()
            n += r.span_steps > before
        if dev.type == "cuda":
            torch.cuda.synchronize()
    engine.abort("profiled")
    while engine.has_unfinished():
        engine.step()
    # kernels and copies only: an op outside a graph (the head's matmul, softmax) is listed
    # both as the aten op and as its kernel, with the same device time
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in events) / n
    host = host_profile(engine, prompt, params)
    phases = host_phases(engine, prompt, params)
    r.lookahead = looking_ahead
    bw = copy_bandwidth(dev) / 1e9
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    kernels = sorted(events, key=lambda e: -e.self_device_time_total)[:30]
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
    (out / f"profile_span_{args.model}_{args.cache}.txt").write_text(table)
    result = {
        "model": args.model,
        "cache": args.cache,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "fused_kernels": not args.no_fused,
        # getattr: the same script times trees from before the forward ahead existed
        "lookahead": looking_ahead,
        "lookahead_taken_dropped": [
            getattr(engine.runner, "lookahead_taken", 0),
            getattr(engine.runner, "lookahead_dropped", 0),
        ],
        "in_block_step_wall_ms_median": round(wall_ms, 3),
        "in_block_steps": len(walls),
        "device_busy_ms_per_step": round(device_us / 1e3, 3),
        "weights_gb": round(weight_bytes / 1e9, 3),
        "copy_bandwidth_gbs": round(bw, 1),
        "weight_read_floor_ms": round(floor_ms, 3),
        "host_phases_ms": phases,
        "host_top_cumulative": host,
        "top_kernels": [
            {
                "name": e.key[:90],
                "calls_per_step": e.count / n,
                "ms_per_step": round(e.self_device_time_total / n / 1e3, 3),
            }  # fmt: skip
            for e in kernels
            if e.self_device_time_total > 0
        ],
    }
    (out / f"profile_span_{args.model}_{args.cache}.json").write_text(json.dumps(result, indent=1))
    print(
        json.dumps({k: v for k, v in result.items() if not k.startswith(("top", "host"))}, indent=1)
    )
    print("host side, cumulative ms per in-block step:")
    for name, ms in host:
        print(f"{ms:8.3f} ms  {name}")
    for k in result["top_kernels"]:
        print(f"{k['ms_per_step']:8.3f} ms {k['calls_per_step']:6.1f}x  {k['name']}")


if __name__ == "__main__":
    main()
