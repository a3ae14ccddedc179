"""At temperature 0 the engine equals the published loops token for token, alone and batched."""

from __future__ import annotations

import pytest
import torch

from dlm_engine import Engine
from dlm_engine.models.common import full_logits
from dlm_lab.reference import dream_generate, llada_generate
from dlm_lab.testing import SAMPLE_PROMPTS as PROMPTS


def _chat(engine: Engine, text: str) -> list[int]:
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


def _llada_ref(engine: Engine, prompt: list[int], **kw) -> list[int]:
    lm = engine.loaded
    x = llada_generate(
        full_logits(lm.model), torch.tensor([prompt]), mask_id=lm.mask_id, eos_id=lm.eos_id, **kw
    )
    return x[0, len(prompt) :].tolist()


def _dream_ref(engine: Engine, prompt: list[int], **kw) -> list[int]:
    lm = engine.loaded
    x = dream_generate(full_logits(lm.model), torch.tensor([prompt]), mask_id=lm.mask_id, **kw)
    return x[0, len(prompt) :].tolist()


def _until_stop(engine: Engine, ids: list[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in engine.stop_ids:
            return ids[:i]
    return ids


LLADA_CASES = [
    dict(max_tokens=32, steps=32, block_length=8),
    dict(max_tokens=32, steps=16, block_length=32),
    dict(max_tokens=24, steps=12, block_length=8),
    dict(max_tokens=16, steps=8, block_length=4, cfg_scale=1.5),
    dict(max_tokens=16, steps=16, block_length=16, suppress_eos=True),
]


@pytest.mark.parametrize(
    "case", LLADA_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
)
def test_llada_alone_equals_reference(engines: dict[str, Engine], case: dict) -> None:
    eng = engines["llada"]
    for text in PROMPTS[:3]:
        prompt = _chat(eng, text)
        out = eng.generate([prompt], case)[0]
        ref = _llada_ref(
            eng,
            prompt,
            steps=case["steps"],
            gen_length=case["max_tokens"],
            block_length=case["block_length"],
            cfg_scale=case.get("cfg_scale", 0.0),
            logits_eos_inf=case.get("suppress_eos", False),
        )
        assert out.token_ids == _until_stop(eng, ref)
        assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus", "topk_margin"])
@pytest.mark.parametrize("steps", [32, 11])
def test_dream_alone_equals_reference(engines: dict[str, Engine], alg: str, steps: int) -> None:
    eng = engines["dream"]
    for text in PROMPTS[:3]:
        prompt = _chat(eng, text)
        out = eng.generate([prompt], dict(max_tokens=32, steps=steps, algorithm=alg))[0]
        ref = _dream_ref(eng, prompt, steps=steps, gen_length=32, alg=alg)
        assert out.token_ids == _until_stop(eng, ref)


def test_early_stop_matches_reference_and_saves_steps(engines: dict[str, Engine]) -> None:
    """A row whose committed prefix holds end-of-text leaves: fewer forwards, same tokens."""
    for name in ("llada_eos", "dream_eos"):
        eng = engines[name]
        params = dict(max_tokens=64, steps=64, block_length=8 if name == "llada_eos" else 64)
        stopped = 0
        for text in PROMPTS:
            prompt = _chat(eng, text)
            out = eng.generate([prompt], params)[0]
            if name == "llada_eos":
                ref = _llada_ref(eng, prompt, steps=64, gen_length=64, block_length=8)
            else:
                ref = _dream_ref(eng, prompt, steps=64, gen_length=64)
            assert out.token_ids == _until_stop(eng, ref)
            if out.finish_reason == "stop":
                stopped += 1
                assert out.completion_tokens == len(out.token_ids) + 1
                # the step count is the first step at which everything before the stop token was committed
                assert out.steps <= 64
            if name == "llada_eos" and out.finish_reason == "stop":
                assert out.steps < 64, "LLaDA must not compute blocks after the stop"
                assert out.steps % 8 == 0 or out.steps < 64
        assert stopped >= 2, f"{name}: expected early stops"


def test_llada_early_stop_step_count(engines: dict[str, Engine]) -> None:
    """Exactly the steps of the blocks up to the one that completed the stop prefix."""
    eng = engines["llada_eos"]
    prompt = _chat(eng, PROMPTS[1])
    out = eng.generate([prompt], dict(max_tokens=64, steps=64, block_length=8))[0]
    assert out.finish_reason == "stop"
    stop_pos = len(out.token_ids)
    # with 1 token per step, the stop token's block must be fully finished only if an earlier
    # position in it was still masked; either way no block after it is ever computed
    assert out.steps <= (stop_pos // 8 + 1) * 8
    assert out.steps < 64
