"""Block-diffusion exactness on the GPU: the engine's fast path (paged KV pool, shared prefix
pages, CUDA graphs on bucketed shapes) against the plain no-cache reference loops.

    python benchmarks/gpu_check_block.py            # prints one line a check, exits 1 on a mismatch
    python benchmarks/gpu_check_block.py --paged-attention gather,flex   # each way of reading pages

The unit tests prove the same equalities on CPU (tests/unit/test_engine_block_diffusion.py);
this runs them where CUDA graphs are captured and replayed. Checks: the embedded trained
`tiny-sdar` on held-out questions with SDAR's four commit rules and Diffulex's multi_bd mixed in one batch (float32),
then the same questions behind one shared system prompt, asked twice so that the second round
reads the first round's prefix pages; and random tiny LLaDA2 checkpoints (float32).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dlm_engine import Engine, EngineConfig
from dlm_lab import testing
from dlm_lab.training import tasks

ROOT = Path(__file__).resolve().parent.parent
SDAR_RULES = [
    {"max_tokens": 32},  # low_confidence_dynamic, the default
    {"max_tokens": 32, "algorithm": "low_confidence_static", "steps": 4},
    {"max_tokens": 32, "algorithm": "low_confidence_static", "steps": 2},
    {"max_tokens": 32, "algorithm": "entropy_bounded", "threshold": 0.5},
    {"max_tokens": 32, "algorithm": "sequential", "steps": 2},
    {"max_tokens": 32, "algorithm": "multi_bd", "buffer_size": 2},  # Diffulex multi_bd
    {"max_tokens": 32, "algorithm": "multi_bd"},  # buffer 4
]
LLADA2_CASES = [
    {"max_tokens": 40, "block_length": 8, "steps": 8},
    {"max_tokens": 24, "block_length": 4, "steps": 2, "threshold": 0.2},
    {"max_tokens": 40},
    {"max_tokens": 40, "block_length": 8, "algorithm": "multi_bd", "threshold": 0.3},
]


def check(name: str, engine: Engine, pairs: list[tuple[list[int], dict]]) -> bool:
    expected = [testing.block_reference(engine, p, c) for p, c in pairs]
    got = [o.token_ids for o in engine.generate([p for p, _ in pairs], [c for _, c in pairs])]
    bad = sum(g != e for g, e in zip(got, expected, strict=True))
    graphs = getattr(engine.runner, "graphs", None)
    captured = graphs.captures if graphs is not None else 0
    print(
        f"{name}: {len(pairs) - bad}/{len(pairs)} rows equal to the reference "
        f"(batched, {captured} CUDA graphs captured)",
        flush=True,
    )
    return bad == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=24, help="held-out questions")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--paged-attention", default="gather", help="comma-separated modes, each checked in turn"
    )
    args = ap.parse_args(argv)
    ok = True
    for mode in args.paged_attention.split(","):
        print(f"paged_attention {mode}", flush=True)
        ok &= check_all(args, mode)
    print("all equal" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


def check_all(args: argparse.Namespace, mode: str) -> bool:
    """Every check with the block rows' pages read the `mode` way."""
    ok = True
    asset = str(ROOT / "dlm_engine" / "assets" / "tiny-sdar")
    sdar = Engine(
        EngineConfig(
            model=asset, device=args.device, dtype="float32", max_rows=128, paged_attention=mode
        )
    )
    exs = tasks.heldout_examples(args.n)
    prompts = [sdar.encode_prompt(messages=tasks.messages_for(e)) for e in exs]
    pairs = [(p, SDAR_RULES[i % len(SDAR_RULES)]) for i, p in enumerate(prompts)]
    ok &= check("tiny-sdar, four rules and multi_bd mixed", sdar, pairs)
    system = {"role": "system", "content": "You answer with the bare result. " * 12}
    shared = [sdar.encode_prompt(messages=[system, *tasks.messages_for(e)]) for e in exs]
    pairs = [(p, SDAR_RULES[i % len(SDAR_RULES)]) for i, p in enumerate(shared)]
    hits0 = sdar.runner.prefix_cache.hit_tokens if sdar.runner.prefix_cache else 0
    for round_ in (1, 2):
        ok &= check(f"tiny-sdar, shared system prompt, round {round_}", sdar, pairs)
    hits = (sdar.runner.prefix_cache.hit_tokens if sdar.runner.prefix_cache else 0) - hits0
    print(f"prefix cache: {hits} prompt tokens read from shared pages", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (0, 1):
            path = testing.make_tiny_checkpoint(Path(tmp) / f"llada2-{seed}", "llada2", seed=seed)
            engine = Engine(
                EngineConfig(model=str(path), device=args.device, max_rows=64, paged_attention=mode)
            )
            texts = ["hello there", "the quick brown fox", "a", "diffusion " * 9]
            pairs = [
                (engine.encode_prompt(text=t), c) for c in LLADA2_CASES for t in texts
            ]  # fmt: skip
            ok &= check(f"random LLaDA2 (seed {seed})", engine, pairs)
    return ok


if __name__ == "__main__":
    sys.exit(main())
