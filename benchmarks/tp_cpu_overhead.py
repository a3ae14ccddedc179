"""What one tensor-parallel forward costs beyond the forward on CPU (gloo): the same batch
through a tiny checkpoint at tensor_parallel_size 1 and 2, per denoising step.

A tiny model's step is almost all fixed cost, so the difference is the per-forward price of
sending the inputs (a JSON header through the store, tensor broadcasts) and the layers'
collectives, not a speed-up; with real weights each rank reads half of them.

    .venv/bin/python benchmarks/tp_cpu_overhead.py [--family dream] [--rows 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from dlm_engine import Engine, EngineConfig
from dlm_lab.testing import SAMPLE_PROMPTS, make_tiny_checkpoint


def per_step_ms(engine: Engine, prompts: list[list[int]], tokens: int, rounds: int) -> float:
    params = {"max_tokens": tokens, "steps": tokens}
    engine.generate(prompts, params)  # warm-up
    best = float("inf")
    for _ in range(rounds):
        before, t0 = engine.runner.forward_passes, time.perf_counter()
        engine.generate(prompts, params)
        steps = engine.runner.forward_passes - before
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="dream", choices=["llada", "dream", "sdar"])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(make_tiny_checkpoint(tempfile.mkdtemp() + "/ckpt", args.family, seed=1))
    for world in (1, 2):
        engine = Engine(EngineConfig(model=path, tensor_parallel_size=world))
        prompts = [engine.encode_prompt(text=t) for t in (SAMPLE_PROMPTS * 4)[: args.rows]]
        ms = per_step_ms(engine, prompts, args.tokens, args.rounds)
        print(f"{args.family} tensor_parallel_size {world}: {ms:.2f} ms per step, {args.rows} rows")
        close = getattr(engine.runner.model, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    main()
