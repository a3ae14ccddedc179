"""gpu_bench.py --section structured: per-step cost of grammar-constrained rows.

Same prompts and schedule (one token per step), batch of unconstrained rows vs the same batch
with every row constrained by a JSON schema; ms per step = wall time / forwards. Prints the
ratio (the target: constrained <= 1.10x unconstrained at batch 8; figures in docs/benchmarks.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dlm_engine import Engine

PROMPT, CANVAS = 64, 128
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        "score": {"type": "number"},
    },
    "required": ["name", "tags", "score"],
}


def _ms_per_step(engine: Engine, prompts: list[list[int]], params: dict) -> tuple[float, int]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = max(o.steps for o in outs)
    return (time.perf_counter() - t0) * 1000 / steps, steps


def run(engine: Engine, model: str, batches: list[int], out: Path) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    vocab = min(100000, engine.runner.model_vocab - 1)
    prompts_all = torch.randint(0, vocab, (max(batches), PROMPT), generator=gen)
    prompts_all[prompts_all == engine.mask_id] = 0
    plain = dict(max_tokens=CANVAS, steps=CANVAS, suppress_eos=True)
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMA}}
    constrained = dict(max_tokens=CANVAS, steps=CANVAS, response_format=fmt)
    print(f"\n== {model}: constrained vs unconstrained rows (ms per step, canvas {CANVAS})")
    print(f"{'batch':>6}{'plain':>10}{'json':>10}{'ratio':>8}{'json steps':>12}")
    for batch in batches:
        prompts = prompts_all[:batch].tolist()
        _ms_per_step(engine, prompts, plain)  # warm-up (graphs, grammar tokenizer)
        _ms_per_step(engine, prompts, constrained)
        base, _ = _ms_per_step(engine, prompts, plain)
        ms, steps = _ms_per_step(engine, prompts, constrained)
        rows.append(dict(model=model, kind="structured", batch=batch, plain_ms=base,
                         constrained_ms=ms, ratio=ms / base, constrained_steps=steps))  # fmt: skip
        print(f"{batch:>6}{base:>10.2f}{ms:>10.2f}{ms / base:>8.3f}{steps:>12}", flush=True)
    return rows
