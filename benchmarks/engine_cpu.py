"""Engine throughput on CPU: tokens/s and steps/s, one request at a time vs 8 concurrent.

Fixed schedule (1 token per step, no early stop possible on a random model of the LLaDA
layout), so the figures measure the engine and the forward, not the model's answers.

    python benchmarks/engine_cpu.py [--model DIR] [--max-tokens 32] [--requests 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from dlm_engine import Engine, EngineConfig
from dlm_lab.testing import SAMPLE_PROMPTS, make_tiny_checkpoint


def run(engine: Engine, prompts: list[list[int]], params: dict, concurrent: bool) -> dict:
    """Seconds, committed tokens, engine steps and mean rows per step to finish all prompts."""
    groups = [prompts] if concurrent else [[p] for p in prompts]
    steps = rows = tokens = 0
    t0 = time.perf_counter()
    for group in groups:
        for p in group:
            engine.add_request(None, p, params)
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            rows += engine.last_step_rows
            tokens += sum(o.completion_tokens for o in outs if o.finished)
    return {
        "seconds": time.perf_counter() - t0,
        "tokens": tokens,
        "steps": steps,
        "rows": rows / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="checkpoint directory (default: a tiny random LLaDA)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        model = str(
            make_tiny_checkpoint(tmp.name, "llada", seed=1, d_model=128, n_layers=4, n_heads=4)
        )
    engine = Engine(EngineConfig(model=model, max_rows=args.requests))
    prompts = [
        engine.encode_prompt(
            messages=[{"role": "user", "content": SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)]}]
        )
        for i in range(args.requests)
    ]
    params = dict(max_tokens=args.max_tokens, steps=args.max_tokens, suppress_eos=True)
    run(engine, prompts[:1], params, concurrent=False)  # warm-up
    print(
        f"model={model} family={engine.family.name} threads={args.threads} canvas={args.max_tokens}"
    )
    print(f"{'mode':<26}{'requests':>9}{'seconds':>9}{'tok/s':>9}{'steps/s':>9}{'rows/step':>10}")
    for label, concurrent in (
        ("batch 1 (one at a time)", False),
        (f"{args.requests} concurrent", True),
    ):
        r = run(engine, prompts, params, concurrent)
        print(
            f"{label:<26}{args.requests:>9}{r['seconds']:>9.2f}{r['tokens'] / r['seconds']:>9.1f}"
            f"{r['steps'] / r['seconds']:>9.1f}{r['rows']:>10.1f}"
        )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
