"""The embedded default model answers held-out questions correctly through the engine.

`dlm-triton serve` with no argument serves `dlm_engine/assets/tiny-dlm`; this guards that
the shipped checkpoint, its tokenizer and the engine's LLaDA path still agree (a broken chat
template, tokenizer, RoPE or decoding change shows up here as lost accuracy). T=0 is
deterministic, so the threshold is a floor, not a statistical bet.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlm_engine import Engine, EngineConfig, SamplingParams
from dlm_lab.training import tasks

ASSET = Path(__file__).resolve().parents[2] / "dlm_engine" / "assets" / "tiny-dlm"
N_QUESTIONS = 60  # ten per task, held out from training by the hash split
MIN_ACCURACY = 0.90


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(ASSET), device="cpu", max_rows=N_QUESTIONS))


def test_checkpoint_is_small_and_complete() -> None:
    """≤ 10 MB shipped, published LLaDA file names, mask token from the config."""
    files = {p.name for p in ASSET.iterdir()}
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert name in files
    assert any(n.endswith(".safetensors") for n in files)
    assert sum(p.stat().st_size for p in ASSET.iterdir()) <= 10 * 1024 * 1024
    cfg = json.loads((ASSET / "config.json").read_text())
    assert cfg["model_type"] == "llada" and "mask_token_id" in cfg


def test_heldout_questions_never_in_training() -> None:
    """The split is by problem, so no held-out question can be drawn for training."""
    import random

    rng = random.Random(0)
    train_keys = {tasks.sample(rng, "train").key for _ in range(20000)}
    test_keys = {e.key for e in tasks.heldout_examples(N_QUESTIONS)}
    assert not train_keys & test_keys
    assert all(tasks.is_heldout(k) for k in test_keys)


def test_heldout_exact_match_at_t0(engine: Engine) -> None:
    """≥ 90% exact match on 60 held-out questions, 1 token per step, T=0."""
    examples = tasks.heldout_examples(N_QUESTIONS)
    params = SamplingParams(max_tokens=32, steps=32, temperature=0.0)
    for i, ex in enumerate(examples):
        engine.add_request(f"q{i}", engine.encode_prompt(messages=tasks.messages_for(ex)), params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    wrong = [
        (ex.question, ex.answer, finals[f"q{i}"].text)
        for i, ex in enumerate(examples)
        if finals[f"q{i}"].text.strip() != ex.answer
    ]
    accuracy = 1 - len(wrong) / len(examples)
    assert accuracy >= MIN_ACCURACY, f"accuracy {accuracy:.1%}; wrong: {wrong}"
    assert all(finals[f"q{i}"].finish_reason == "stop" for i in range(len(examples)))
