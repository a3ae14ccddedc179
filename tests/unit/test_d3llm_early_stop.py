"""d3LLM's early stop (`early_stop`, the published runs' setting) in multi-block decoding.

Once the canvas holds end-of-text, every position after the first one becomes end-of-text and
the blocks past it close; the tokens before it then follow a different path than a run that
only cuts its output at the stop id. On tiny checkpoints that decode end-of-text mid-canvas
the engine equals the plain restatement of upstream (`reference.d3llm_multi_block_generate`
with `eos_id`) alone and batched with unlike rows, and the cases are checked to be ones where
early stop changes the answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm_engine import Engine, EngineConfig, InvalidRequestError
from dlm_engine.decoding.checkpoint_defaults import write_d3llm_card
from dlm_engine.decoding.multi_block import MultiBlockState
from dlm_engine.models.common import full_logits
from dlm_engine.sampling_params import Acceleration
from dlm_lab.reference import d3llm_multi_block_generate
from dlm_lab.testing import SAMPLE_PROMPTS as PROMPTS
from dlm_lab.testing import chat_prompt, make_tiny_checkpoint, until_stop

SHORT = dict(max_tokens=64, block_length=8, threshold=0.5)
PARALLEL = dict(max_tokens=48, block_length=8, threshold=3.0, block_add_threshold=0.0,
                decoded_token_threshold=1.0)  # fmt: skip
WIDE = dict(max_tokens=64, block_length=16, threshold=2.5, block_add_threshold=0.5,
            decoded_token_threshold=0.5)  # fmt: skip
# per checkpoint: cases among which early stop changes some answer (checked below)
CASES = {"llada_eos": [PARALLEL, SHORT], "dream_eos": [WIDE, SHORT]}


def _reference(eng: Engine, prompt: list[int], case: dict, *, early_stop: bool) -> list[int]:
    lm = eng.loaded
    x = d3llm_multi_block_generate(
        full_logits(lm.model),
        torch.tensor([prompt]),
        family=lm.family.name,
        mask_id=lm.mask_id,
        gen_length=case["max_tokens"],
        block_size=case["block_length"],
        threshold=case["threshold"],
        block_add_threshold=case.get("block_add_threshold", 0.1),
        decoded_token_threshold=case.get("decoded_token_threshold", 0.95),
        eos_id=lm.eos_id if early_stop else None,
    )
    return until_stop(eng, x[0, len(prompt) :].tolist())


def _params(case: dict, early_stop: bool) -> dict:
    return dict(case, multi_block=True, early_stop=early_stop, temperature=0.0)


@pytest.mark.parametrize("name", ["llada_eos", "dream_eos"])
def test_early_stop_equals_d3llm(engines, name) -> None:
    eng = engines[name]
    changed = 0
    for case in CASES[name]:
        for text in PROMPTS[:3]:
            prompt = chat_prompt(eng, text)
            ref = _reference(eng, prompt, case, early_stop=True)
            out = eng.generate([prompt], _params(case, True))[0]
            assert out.token_ids == ref, (case, text)
            if not changed:
                changed += ref != _reference(eng, prompt, case, early_stop=False)
    assert changed, "early stop changed no answer: the cases would prove nothing"


@pytest.mark.parametrize("name", ["llada_eos", "dream_eos"])
def test_early_stop_batched_with_unlike_rows_equals_alone(engines, name) -> None:
    eng = engines[name]
    early = CASES[name]
    rows = [_params(c, True) for c in early] + [
        _params(SHORT, False),
        dict(max_tokens=32, steps=32, block_length=8),
        dict(max_tokens=32, steps=16, block_length=8, cache="prefix"),
    ]
    prompts = [chat_prompt(eng, PROMPTS[(i + 1) % 4] + " " * (i // 4)) for i in range(len(rows))]
    alone = [eng.generate([p], c)[0] for p, c in zip(prompts, rows, strict=True)]
    for i, case in enumerate(early):  # the early-stop rows equal upstream alone
        assert alone[i].token_ids == _reference(eng, prompts[i], case, early_stop=True)
    half = len(rows) // 2
    for i in range(half):
        eng.add_request(f"e{i}", prompts[i], rows[i])
    final = {o.request_id: o for _ in range(2) for o in eng.step() if o.finished}
    for i in range(half, len(rows)):  # the rest join mid-flight
        eng.add_request(f"e{i}", prompts[i], rows[i])
    final.update({o.request_id: o for o in eng.outputs() if o.finished})
    got = [(final[f"e{i}"].token_ids, final[f"e{i}"].text) for i in range(len(rows))]
    assert got == [(o.token_ids, o.text) for o in alone]


def test_state_fills_after_eos_and_closes_later_blocks() -> None:
    m, eos = 99, 7
    state = MultiBlockState(16, 4, Acceleration(multi_block=True, block_add_threshold=0.25),
                            eos_id=eos)  # fmt: skip
    canvas = [1, 2, m, 3, eos, m, 5, m] + [m] * 8
    state.absorb(canvas, m)
    assert canvas == [1, 2, m, 3, eos] + [eos] * 11  # end-of-text after the first one
    assert state.fill_from == 5 and state.stale == (5, 7, *range(8, 16))
    assert [(b.masks, b.active) for b in state.blocks[1:]] == [(0, True)] * 3
    assert state.blocks[0].masks == 1 and state.window() == (0, 16)
    canvas[5] = 42  # a commit after end-of-text (a stale candidate) is undone by the next fill
    canvas[2] = 4
    state.absorb(canvas, m)
    assert canvas[5] == eos and state.fill_from == 5 and state.stale == ()
    canvas_off = [1, eos, m, m] + [m] * 12
    off = MultiBlockState(16, 4, Acceleration(multi_block=True))
    off.absorb(canvas_off, m)
    assert canvas_off[2:] == [m] * 14 and off.fill_from is None


@pytest.fixture(scope="module")
def d3llm(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path: Path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("d3") / "d3LLM_LLaDA", "llada", seed=1, eos_boost=0.35
    )
    write_d3llm_card(path, "llada")
    return Engine(EngineConfig(model=str(path), max_rows=4))


def test_d3llm_checkpoint_stops_early_by_default(d3llm) -> None:
    assert d3llm.resolve_params(dict(max_tokens=64)).accel.early_stop is True
    # not with the delayed cache (published for the no-cache loop), nor with another rule
    assert d3llm.resolve_params(dict(cache="prefix")).accel.early_stop is False
    assert d3llm.resolve_params(dict(algorithm="low_confidence")).accel.early_stop is False
    assert d3llm.resolve_params(dict(early_stop=False)).accel.early_stop is False

    prompt = chat_prompt(d3llm, PROMPTS[1])
    case = dict(max_tokens=48, block_length=8, threshold=0.5)
    out = d3llm.generate([prompt], dict(max_tokens=48, block_length=8))[0]
    assert out.token_ids == _reference(d3llm, prompt, case, early_stop=True)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(early_stop=True, multi_block=False), "early_stop"),
        (dict(early_stop=True, multi_block=True, cache="prefix"), "early_stop"),
        (dict(early_stop="maybe", multi_block=True), "early_stop"),
    ],
)
def test_bad_early_stop_names_the_field(engines, params, field) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["llada"].resolve_params(dict(params, max_tokens=32))
    assert err.value.field == field


def test_early_stop_alone(engines) -> None:
    """`early_stop: true` alone means multi-block (as its other keys do); `false` alone is
    accepted on any rule and changes nothing."""
    on = engines["llada"].resolve_params(dict(max_tokens=32, early_stop=True))
    assert (on.accel.multi_block, on.accel.early_stop, on.algorithm) == (
        True,
        True,
        "entropy_threshold",
    )
    off = engines["llada"].resolve_params(dict(max_tokens=32, early_stop=False))
    assert (off.accel.multi_block, off.accel.early_stop) == (False, False)


def test_stale_positions_land_in_the_window() -> None:
    """The fill's positions become candidates at their window offsets; other rows get none."""
    from types import SimpleNamespace as NS

    from dlm_engine.model_runner import _early_stop_stale

    filled = NS(multi=NS(stale=(5, 7, 9)), window_start=12, prompt_len=10, window_width=6)
    plain = NS(multi=None, window_start=3, prompt_len=3, window_width=4)
    quiet = NS(multi=NS(stale=()), window_start=3, prompt_len=3, window_width=4)
    assert _early_stop_stale([plain, quiet], 8) is None
    rows = _early_stop_stale([filled, plain], 8)  # window [2, 8) of the canvas
    assert rows == [[False, False, False, True, False, True, False, False], [False] * 8]
