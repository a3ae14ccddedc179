"""Where a CUDA graph stops paying for itself: one step that feeds whole sequences (cached rows
at a block start: a refresh), timed eager and replayed from a graph, at several row counts.

    python benchmarks/graph_vs_eager.py --out OUT_DIR       # LLaDA-8B architecture on CUDA

An eager forward's host side (kernel launches, the compiled pieces' guards) is a fixed cost
per step; a graph replays it for nothing but costs a capture (many eager forwards' worth) per
new shape. `EngineConfig.cuda_graph_max_tokens` is set where the device's arithmetic outlasts the
eager host side. Random bf16 weights (fixed schedules: the timing is honest); prompt 64,
canvas 256, block 32, 64 steps: a refresh row feeds 320 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.loader import random_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from traffic import graph_captures  # noqa: E402

PROMPT, CANVAS, BLOCK, STEPS = 64, 256, 32, 64


def timed_step(engine: Engine) -> tuple[float, int]:
    """ms of one engine step (device synchronised) and the CUDA graphs it captured."""
    captures0 = graph_captures(engine.runner)
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3, graph_captures(engine.runner) - captures0


def refresh_steps(engine: Engine, prompt: list[int], rows: int, params: dict) -> list[tuple]:
    """Run `rows` requests together; (ms, captures) of each refresh step (more than a span
    per row)."""
    for _ in range(rows):
        engine.add_request(None, prompt, params)
    out: list[tuple[float, int]] = []
    while engine.has_unfinished():
        tokens0 = engine.runner.work["tokens"]
        step = timed_step(engine)
        if engine.runner.work["tokens"] - tokens0 > rows * BLOCK:
            out.append(step)
    return out


def workload(model: str) -> tuple:
    """(random bf16 weights of `model` on CUDA, a PROMPT-token prompt, dual-cache params)."""
    lm = random_checkpoint(model, "bfloat16", "cuda")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 30000, (PROMPT,), generator=gen).tolist()
    return lm, prompt, dict(max_tokens=CANVAS, steps=STEPS, block_length=BLOCK, cache="dual")


def setup(doc: str, rows: str, out: str) -> tuple:
    """Command line (--model, --rows, --out) and workload: (args, out dir, rows, lm, prompt,
    params)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default="llada-8b")
    ap.add_argument("--rows", default=rows)
    ap.add_argument("--out", default=out)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lm, prompt, params = workload(args.model)
    return args, out_dir, [int(r) for r in args.rows.split(",")], lm, prompt, params


def main() -> None:
    args, out, rows, lm, prompt, params = setup(__doc__, "1,2,3,4,5,6,8", "graph_vs_eager_out")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    print(
        f"{result['device']}, {args.model} random bf16, refresh steps (median ms, first left out)"
    )
    print(f"{'rows':>4} {'tokens':>6} {'graph':>7} {'eager':>7}")
    for n in rows:
        medians = {}
        for name, limit in (("graph", 0), ("eager", 1)):  # 1: every refresh step runs eagerly
            cfg = EngineConfig(model=f"random:{args.model}", device="cuda", max_rows=max(rows),
                               max_canvas=CANVAS, cuda_graph_max_tokens=limit)  # fmt: skip
            engine = Engine(cfg, loaded=lm)
            refresh_steps(engine, prompt, n, params)  # captures, compiles
            walls = [ms for ms, _ in refresh_steps(engine, prompt, n, params)]
            medians[name] = round(statistics.median(walls[1:]), 2)
            del engine
        result["rows"][n] = {"tokens": n * (PROMPT + CANVAS), **medians}
        print(f"{n:>4} {n * (PROMPT + CANVAS):>6} {medians['graph']:>7} {medians['eager']:>7}")
    (out / "graph_vs_eager.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
