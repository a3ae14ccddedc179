"""`Engine.warm_up`: one short chat request before serving (on CUDA: kernels compiled, first
graphs captured before the first client's request). It does nothing on the CPU unless forced;
forced, it finishes, and every later request's tokens equal those of an engine never warmed
up, for a masked-diffusion, a block-diffusion (prefix cache: the warm-up's pages carry their
own salt) and a uniform-diffusion model."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlm_engine import Engine, EngineConfig
from dlm_lab.testing import make_tiny_checkpoint
from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

CASES = {
    "llada": {"max_tokens": 16, "steps": 8},
    "sdar": {"max_tokens": 16},
    "gemma": {"max_tokens": 16, "seed": 3},
}


def _checkpoint(root: Path, kind: str) -> Path:
    if kind == "gemma":
        return make_tiny_diffusion_gemma(root / kind)
    return make_tiny_checkpoint(root / kind, kind, seed=2)


@pytest.mark.parametrize("kind", list(CASES))
def test_a_warm_up_changes_no_later_token(tmp_path: Path, kind: str) -> None:
    path = str(_checkpoint(tmp_path, kind))
    cold = Engine(EngineConfig(model=path, dtype="float32", max_rows=4))
    warm = Engine(EngineConfig(model=path, dtype="float32", max_rows=4))
    assert warm.warm_up() is None  # the CPU: nothing to compile or capture
    assert warm.warm_up(force=True) > 0
    assert not warm.has_unfinished()
    chat = [{"role": "user", "content": "Hello!"}]  # the warm-up's own prompt too
    prompts = [warm.encode_prompt(messages=chat), warm.encode_prompt(text="2+2=")]
    for prompt in prompts:
        got = warm.generate([prompt], CASES[kind])[0]
        want = cold.generate([prompt], CASES[kind])[0]
        assert got.token_ids == want.token_ids
        assert got.cached_tokens == want.cached_tokens  # no hit on the warm-up's pages


def test_a_tokenizer_without_a_chat_template_warms_up_on_text(tmp_path: Path) -> None:
    engine = Engine(EngineConfig(model=str(_checkpoint(tmp_path, "llada")), max_rows=2))
    engine.tokenizer.chat_template = None  # a base model's
    assert engine.warm_up(force=True) > 0
