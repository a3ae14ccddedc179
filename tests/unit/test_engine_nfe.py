"""Forwards (NFE) accounting and the `max_nfe` cap, in the engine (no Triton)."""

from __future__ import annotations

import pytest

from dlm_engine import Engine, RequestOutput


def _prompt(eng: Engine) -> list[int]:
    return eng.encode_prompt(messages=[{"role": "user", "content": "hi"}])


def _run(eng: Engine, params: dict) -> list[RequestOutput]:
    """Every output of one request (denoise mode: one per step, with the canvas)."""
    rid = eng.add_request(None, _prompt(eng), {**params, "stream_mode": "denoise"})
    outs = [o for o in eng.outputs() if o.request_id == rid]
    assert outs[-1].finished
    return outs


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_forwards_and_tokens_per_forward_are_reported(engines, family: str) -> None:
    eng = engines[family]
    out = eng.generate([_prompt(eng)], {"max_tokens": 16, "steps": 8})[0]
    assert 0 < out.forwards == out.steps <= 8
    assert out.tokens_per_forward == pytest.approx(out.completion_tokens / out.forwards, abs=1e-4)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_max_nfe_caps_forwards_and_commits_the_active_block(engines, family: str) -> None:
    eng = engines[family]
    base = {"max_tokens": 16, "steps": 16, "block_length": 8, "suppress_eos": True}
    if family == "dream":
        base = {"max_tokens": 16, "steps": 16, "suppress_eos": False}
    free = _run(eng, base)
    capped = _run(eng, {**base, "max_nfe": 3})
    final = capped[-1]
    assert final.forwards == 3 and len(capped) == 3
    # The first two steps are the uncapped run's: the cap changes only the forward reaching it.
    assert [o.canvas for o in capped[:2]] == [o.canvas for o in free[:2]]
    canvas = final.canvas
    width = 8 if family == "llada" else 16
    assert None not in canvas[:width], "the active block is committed by the last forward"
    assert all(t is None for t in canvas[width:]), "later blocks are never computed"
    # What steps 1-2 committed stays; the rest of the block was filled by the third forward.
    for before, after in zip(free[1].canvas[:width], canvas[:width], strict=True):
        assert before is None or before == after
    if final.finish_reason == "length":
        assert final.completion_tokens == width
    else:
        assert final.finish_reason == "stop" and final.completion_tokens <= width
    assert final.tokens_per_forward == pytest.approx(final.completion_tokens / 3, abs=1e-4)


def test_max_nfe_with_threshold_and_above_the_schedule(engines) -> None:
    eng = engines["llada"]
    p = _prompt(eng)
    base = {"max_tokens": 16, "steps": 16, "block_length": 8}
    free, high, capped = eng.generate(
        [p, p, p],
        [base, {**base, "max_nfe": 64}, {**base, "threshold": 0.999, "max_nfe": 2}],
    )
    assert high.token_ids == free.token_ids and high.forwards == free.forwards
    assert capped.forwards <= 2 and capped.finished
    assert capped.finish_reason in ("stop", "length")


def test_batched_capped_rows_equal_alone(engines) -> None:
    eng = engines["dream"]
    p = _prompt(eng)
    settings = [
        {"max_tokens": 16, "steps": 16, "max_nfe": 2},
        {"max_tokens": 24, "steps": 12},
        {"max_tokens": 8, "steps": 8, "max_nfe": 5, "temperature": 0.8, "seed": 3},
    ]
    batched = eng.generate([p] * 3, settings)
    alone = [eng.generate([p], s)[0] for s in settings]
    for b, a in zip(batched, alone, strict=True):
        assert (b.token_ids, b.forwards, b.finish_reason) == (
            a.token_ids,
            a.forwards,
            a.finish_reason,
        )
    assert batched[0].forwards == 2 and batched[2].forwards <= 5
