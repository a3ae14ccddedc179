"""Where a block-diffusion step's time goes at a given batch: cProfile of the
host side of steady-state steps, plus the step wall time with and without waiting for the
device. `python benchmarks/profile_block.py --model sdar-4b --batch 128`."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.loader import random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sdar-4b")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    lm = random_checkpoint(args.model, "bfloat16", args.device)
    block = int(lm.config.get("block_size") or lm.family.default_block_length)
    cfg = EngineConfig(model=f"random:{args.model}", device=args.device, dtype="bfloat16",
                       max_rows=args.batch, max_canvas=512 + block, max_queue=4 * args.batch)  # fmt: skip
    engine = Engine(cfg, lm)
    params = {"max_tokens": 512, "block_length": block, "algorithm": "low_confidence_static"}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (64,), generator=gen).tolist() for _ in range(args.batch)]
    engine.generate(prompts, dict(params, max_tokens=64))  # graphs for the usual shapes
    for p in prompts:
        engine.add_request(None, p, params)
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize() if args.device == "cuda" else None
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    print(f"step wall {1e3 * (time.perf_counter() - t) / args.steps:.2f} ms (batch {args.batch})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumtime").print_stats(22)


if __name__ == "__main__":
    main()
