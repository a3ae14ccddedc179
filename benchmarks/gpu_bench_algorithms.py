"""GPU benchmark section: what each decoding algorithm costs per forward.

Run through `benchmarks/gpu_bench.py --section algorithms` (LLaDA-8B and Dream-7B
architectures, random bf16 weights, CUDA graphs as served):

1. per-forward cost of each algorithm against low_confidence at equal query length: the same
   rows (prompt 64, canvas 256, block 32) stepped with one algorithm at a time; the canvas is
   restored before every step, so every timed step sees the same masks and the same query;
2. multi-block step time against the number of blocks in flight (1, 2, 4, 8 blocks of 32):
   the window the step decodes grows; the forward over the sequence does not.

Tokens per forward on random weights says nothing about any algorithm (a random model has no
confident positions); this only measures cost. The tiny-dlm curves in docs/benchmarks.md are
the evidence for what the algorithms buy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dlm_engine import Engine
from dlm_engine.decoding.multi_block import Block
from dlm_engine.sequence import Sequence

PROMPT, CANVAS, BLOCK = 64, 256, 32

ALGORITHMS: dict[str, dict] = {
    "low_confidence": dict(steps=CANVAS),
    "threshold": dict(threshold=0.9),
    "factor": dict(algorithm="factor", factor=1.0),
    "local_leap": dict(steps=CANVAS, use_local_leap=True),
    "entropy_threshold": dict(algorithm="entropy_threshold", threshold=0.5),
    "multi_block (1 block)": dict(multi_block=True, threshold=0.5),
}
LLADA_ONLY = {"factor", "local_leap"}
# cached steps at equal query length (the suffix from the prompt's end): Fast-dLLM's prefix
# cache inside a block against d3LLM's delayed cache on a span step
CACHED: dict[str, dict] = {
    "low_confidence, prefix cache, in-block": dict(steps=CANVAS, cache="prefix"),
    "multi_block, prefix cache, span step": dict(multi_block=True, threshold=0.5, cache="prefix"),
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rows(
    engine: Engine, prompts: list[list[int]], params: dict, blocks: int = 0, span: bool = False
) -> list:
    resolved = engine.resolve_params(dict(params, max_tokens=CANVAS, block_length=BLOCK))
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(
            f"b{i}",
            p,
            resolved,
            family=engine.family.name,
            mask_id=engine.mask_id,
            device=engine.loaded.device,
        )
        if blocks and s.multi is not None:  # `blocks` blocks in flight, all still masked
            s.multi.blocks = [Block(b * BLOCK, (b + 1) * BLOCK, BLOCK, True) for b in range(blocks)]
        if span and s.multi is not None:  # the prompt's keys cached: a span from its end
            c = s.multi.cache
            c.prompt.cached, c.exists, c.length, c.planned = True, True, 0, ("span", 0)
        elif span:  # Fast-dLLM: a step inside the block reads the cache
            s.step_in_block = 1
        seqs.append(s)
    return seqs


class StepTimer:
    """Times `runner.step` over fixed rows, the canvas restored before each step so every
    timed step sees the same masks and query."""

    def __init__(self, engine: Engine, seqs: list) -> None:
        self.engine, self.seqs = engine, seqs
        self.saved = [s.tokens.clone() for s in seqs]
        self.times: list[float] = []
        for _ in range(3):  # graph capture and warm-up
            self.one()
        self.times.clear()

    def one(self) -> None:
        dev = self.engine.loaded.device
        for s, t in zip(self.seqs, self.saved, strict=True):
            s.tokens.copy_(t)
        _sync(dev)
        t0 = time.perf_counter()
        # no forward queued ahead: every timed step restores its tokens and runs its own
        self.engine.runner.step(self.seqs, look_ahead=False)
        _sync(dev)
        self.times.append(time.perf_counter() - t0)

    @property
    def median_ms(self) -> float:
        t = sorted(self.times)
        return t[len(t) // 2] * 1e3


def time_interleaved(timers: list[StepTimer], iters: int, rounds: int = 5) -> list[float]:
    """Median ms per step of each timer, measured in `rounds` alternating rounds so that a
    drift of the machine (clocks, other tenants) falls on every setting alike: at a few
    percent, ratios of back-to-back medians were within noise of the <= 5% goal."""
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for t in timers:
            for _ in range(per_round):
                t.one()
    return [t.median_ms for t in timers]


def run(engine: Engine, model: str, batches: list[int], iters: int, out: Path) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    vocab = min(100000, engine.runner.model_vocab - 1)
    prompts_all = torch.randint(0, vocab, (max(batches), PROMPT), generator=gen)
    prompts_all[prompts_all == engine.mask_id] = 0
    print(f"\n== {model}: per-forward cost at equal query length (ms per step, median)")
    print(f"{'algorithm':<24}{'batch':>6}{'ms/step':>10}{'vs low_conf':>12}")
    for batch in batches:
        prompts = prompts_all[:batch].tolist()
        for table, kind, width in (
            (ALGORITHMS, "per_forward", 24),
            (CACHED, "per_forward_cached", 40),
        ):
            names = [n for n in table if not (n in LLADA_ONLY and engine.family.name != "llada")]
            span = kind == "per_forward_cached"
            timers = [StepTimer(engine, _rows(engine, prompts, table[n], span=span)) for n in names]
            times = time_interleaved(timers, iters * 2)
            for name, ms in zip(names, times, strict=True):
                rows.append(dict(model=model, kind=kind, algorithm=name, batch=batch, ms=ms,
                                 ratio=ms / times[0]))  # fmt: skip
                print(f"{name:<{width}}{batch:>6}{ms:>10.2f}{ms / times[0]:>12.3f}", flush=True)
    print(f"\n== {model}: multi-block step time vs blocks in flight (block {BLOCK})")
    print(f"{'blocks':>6}{'batch':>6}{'ms/step':>10}{'vs 1 block':>12}{'low_conf same width':>21}")
    for batch in batches:
        prompts = prompts_all[:batch].tolist()
        one_block = None
        for blocks in (1, 2, 4, 8):
            seqs = _rows(engine, prompts, dict(multi_block=True, threshold=0.5), blocks)
            wide = engine.resolve_params(
                dict(max_tokens=CANVAS, block_length=BLOCK * blocks, steps=CANVAS)
            )
            same = [
                Sequence(
                    f"w{i}",
                    p,
                    wide,
                    family=engine.family.name,
                    mask_id=engine.mask_id,
                    device=engine.loaded.device,
                )  # fmt: skip
                for i, p in enumerate(prompts)
            ]
            ms, ms_lc = time_interleaved([StepTimer(engine, seqs), StepTimer(engine, same)], iters)
            one_block = one_block or ms
            rows.append(dict(model=model, kind="multi_block", blocks=blocks, batch=batch, ms=ms,
                             ratio=ms / one_block, low_conf_same_width_ms=ms_lc))  # fmt: skip
            print(f"{blocks:>6}{batch:>6}{ms:>10.2f}{ms / one_block:>12.3f}{ms_lc:>21.2f}",
                  flush=True)  # fmt: skip
    (out / f"algorithms_{model}.json").write_text(json.dumps(rows, indent=1))
    return rows
