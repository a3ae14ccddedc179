"""The accelerated decoding algorithms on the GPU: the fast path (packed forward, CUDA graphs on
bucketed shapes, KV pool slots) against the plainly restated upstream loops.

    python benchmarks/gpu_check_algorithms.py     # one line a check; exits 1 on a mismatch

The unit tests prove the same equalities on CPU (tests/unit/test_accelerated_decoding.py and
tests/unit/test_multi_block_cache.py); this runs them where graphs are captured and replayed.
Random tiny LLaDA and Dream checkpoints in float32 (TF32 off), temperature 0: each algorithm
alone against its reference on four prompts, then every case of a family in one batch against
the same cases run alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.models.common import full_logits
from dlm_lab import reference
from dlm_lab.testing import SAMPLE_PROMPTS, chat_prompt, make_tiny_checkpoint, until_stop

MB = dict(block_add_threshold=0.1, decoded_token_threshold=0.95)


def cases(family: str) -> list[tuple[str, dict, object, dict]]:
    """(name, request, reference loop, its keyword arguments)."""
    out: list[tuple[str, dict, object, dict]] = [
        (
            "entropy_threshold",
            dict(max_tokens=32, block_length=8, algorithm="entropy_threshold", threshold=0.5),
            reference.d3llm_entropy_generate,
            dict(family=family, gen_length=32, block_length=8, threshold=0.5),
        ),
        (
            "multi_block",
            dict(max_tokens=48, block_length=8, multi_block=True, threshold=2.5),
            reference.d3llm_multi_block_generate,
            dict(family=family, gen_length=48, block_size=8, threshold=2.5, **MB),
        ),
    ]
    for delay in (1, 2):  # d3LLM's delayed KV cache: full, cache, span and refresh steps
        out.append(
            (
                f"multi_block + prefix cache, delay {delay}",
                dict(
                    max_tokens=48,
                    block_length=8,
                    multi_block=True,
                    threshold=2.5,
                    cache="prefix",
                    cache_delay_iter=delay,
                ),  # fmt: skip
                reference.d3llm_multi_block_cached_generate,
                dict(
                    family=family,
                    gen_length=48,
                    block_size=8,
                    threshold=2.5,
                    cache_delay_iter=delay,
                    **MB,
                ),  # fmt: skip
            )
        )
    if family == "llada":
        out += [
            (
                "factor",
                dict(max_tokens=32, block_length=8, algorithm="factor", factor=2.0),
                reference.fast_dllm_factor_generate,
                dict(gen_length=32, block_length=8, factor=2.0),
            ),
            (
                "local_leap",
                dict(
                    max_tokens=32,
                    steps=16,
                    block_length=8,
                    use_local_leap=True,
                    anchor_threshold=0.3,
                    neighbor_threshold=0.2,
                ),  # fmt: skip
                reference.local_leap_generate,
                dict(
                    steps=16,
                    gen_length=32,
                    block_length=8,
                    anchor_threshold=0.3,
                    neighbor_threshold=0.2,
                    radius=4,
                ),  # fmt: skip
            ),
        ]
    return out


def expected(engine: Engine, fn, prompt: list[int], kw: dict) -> list[int]:
    lm = engine.loaded
    cached = fn is reference.d3llm_multi_block_cached_generate
    model = lm.model if cached else full_logits(lm.model)  # it runs its own KV cache
    x = fn(model, torch.tensor([prompt], device=lm.device), mask_id=lm.mask_id, **kw)
    return until_stop(engine, x[0, len(prompt) :].tolist())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llada", "dream"):
            ckpt = make_tiny_checkpoint(Path(tmp) / family, family)
            eng = Engine(EngineConfig(model=str(ckpt), device=args.device, dtype="float32",
                                      max_rows=32))  # fmt: skip
            prompts = [chat_prompt(eng, t) for t in SAMPLE_PROMPTS[:4]]
            batch_prompts, batch_params, alone = [], [], []
            for name, params, fn, kw in cases(family):
                got = [o.token_ids for o in eng.generate(prompts, [params] * len(prompts))]
                want = [expected(eng, fn, p, kw) for p in prompts]
                good = sum(g == w for g, w in zip(got, want, strict=True))
                ok &= good == len(prompts)
                print(f"{family:<6}{name:<36}{good}/{len(prompts)} equal to the reference")
                batch_prompts += prompts
                batch_params += [params] * len(prompts)
                alone += want
            got = [o.token_ids for o in eng.generate(batch_prompts, batch_params)]
            good = sum(g == w for g, w in zip(got, alone, strict=True))
            ok &= good == len(alone)
            graphs = getattr(eng.runner, "graphs", None)
            print(f"{family:<6}{'all cases in one batch':<36}{good}/{len(alone)} equal "
                  f"({graphs.captures if graphs else 0} CUDA graphs captured)")  # fmt: skip
    print("all equal" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
