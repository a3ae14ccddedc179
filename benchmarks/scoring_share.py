"""A generation neighbour's latency alone and beside a big scoring request, in process (CPU).

    python benchmarks/scoring_share.py [--tokens 1000] [--samples 1024] [--runs 7]

Loads a tiny random LLaDA (dlm_lab.testing) twice: with scoring's share of the steps
(dlm_engine/scoring.py) and with the rule it replaced, emulated (a whole batch of 8 samples in
every step, generation or not). For each: the median latency of a 32-step chat request alone,
then beside a scoring request of `--tokens` tokens with `--samples` samples. Latency is counted
in this process's CPU seconds on one torch thread, so other work on a shared machine does not
enter the figures (on an idle machine they equal wall time).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dlm_engine import Engine, EngineConfig
from dlm_lab.testing import make_tiny_checkpoint

GEN = {"max_tokens": 32, "steps": 32}


def _old_rule(eng: Engine) -> None:
    """A whole batch in every step: the chunk is the batch, and no share is waited for."""
    queue = eng._scoring
    queue.take_turn = lambda busy: queue.next_chunk() if queue.jobs else None


def _latency(eng: Engine, prompt: list[int], rid: str) -> float:
    eng.add_request(rid, prompt, GEN)
    t0 = time.process_time()
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return time.process_time() - t0


def measure(ckpt: Path, old: bool, tokens: int, samples: int, runs: int) -> tuple[float, float]:
    eng = Engine(EngineConfig(model=str(ckpt), max_rows=8, score_step_tokens=65_536 * old))
    if old:
        _old_rule(eng)
    prompt = eng.encode_prompt(messages=[{"role": "user", "content": "What is 2+2?"}])
    _latency(eng, prompt, "warm")
    alone = statistics.median(_latency(eng, prompt, f"a{i}") for i in range(runs))
    text = ("The quick brown fox jumps over the lazy dog. " * (tokens // 40 + 1))[:tokens]
    ids = eng.tokenizer.encode(text, add_special_tokens=False)
    eng.add_request("score", ids, {"score": True, "mc_samples": samples, "seed": 1})
    eng.step()
    beside = statistics.median(_latency(eng, prompt, f"b{i}") for i in range(runs))
    return alone, beside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "llada", "llada", seed=3)
        for old in (True, False):
            alone, beside = measure(ckpt, old, args.tokens, args.samples, args.runs)
            rule = "whole batch every step (before)" if old else "shared steps"
            print(
                f"{rule}: neighbour alone {alone * 1e3:.0f} ms, beside {args.samples} x "
                f"{args.tokens} tokens {beside * 1e3:.0f} ms (ratio {beside / alone:.2f})"
            )


if __name__ == "__main__":
    main()
