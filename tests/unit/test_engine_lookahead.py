"""The next step's forward queued before the step's copy (dlm_engine/lookahead.py): on CUDA
the device runs it while the host reads the copy. Turned on here on the CPU, it must change no
token, be taken by the next step when the rows stay in their block, and be dropped (never
used) when the rows change: a row that stops early, an abort. An arrival while one waits
joins a step later and gets the tokens it gets alone."""

from __future__ import annotations

import pytest

from dlm_engine import Engine
from dlm_lab.testing import SAMPLE_PROMPTS

CASES = {
    "llada": [
        dict(max_tokens=32, steps=16, block_length=8, cache="dual"),
        dict(max_tokens=24, steps=12, block_length=8, cache="prefix"),
        dict(max_tokens=16, steps=16, block_length=8),
        dict(max_tokens=32, steps=16, block_length=8, cache="dual", threshold=0.5),
        dict(max_tokens=16, steps=8, block_length=8, cfg_scale=1.0),
    ],
    "dream": [
        dict(max_tokens=32, steps=16, block_length=8, cache="dual"),
        dict(max_tokens=32, steps=16, block_length=8, cache="dual", algorithm="topk_margin"),
        dict(max_tokens=16, steps=16),
        dict(max_tokens=16, steps=16, algorithm="origin", seed=3),
    ],
}


def _prompt(eng: Engine, i: int) -> list[int]:
    text = SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)] + " " * (i // len(SAMPLE_PROMPTS))
    return eng.encode_prompt(messages=[{"role": "user", "content": text}])


def _key(o) -> tuple:
    return (o.token_ids, o.text, o.finish_reason, o.steps, o.completion_tokens)


@pytest.fixture
def looking_ahead(engines: dict[str, Engine]):
    for eng in engines.values():
        eng.runner.lookahead = True
    yield engines
    for eng in engines.values():
        eng.runner.lookahead = False
        eng.runner.drop_lookahead()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_lookahead_changes_no_token(looking_ahead: dict[str, Engine], family: str) -> None:
    """Alone and batched with unlike rows (thresholds, CFG, Dream's `origin` draws, exact
    rows): the same tokens with the forward queued ahead as without, and it was taken."""
    eng = looking_ahead[family]
    runner, cases = eng.runner, CASES[family]
    prompts = [_prompt(eng, i) for i in range(len(cases))]
    runner.lookahead = False
    alone = [_key(eng.generate([p], c)[0]) for p, c in zip(prompts, cases, strict=True)]
    batched = [_key(o) for o in eng.generate(prompts, cases)]
    runner.lookahead = True
    taken = runner.lookahead_taken
    alone_ahead = [_key(eng.generate([p], c)[0]) for p, c in zip(prompts, cases, strict=True)]
    assert runner.lookahead_taken > taken
    batched_ahead = [_key(o) for o in eng.generate(prompts, cases)]
    assert alone_ahead == alone
    assert batched_ahead == batched == alone
    # rows whose commit count is fixed (no threshold, no `origin` draw) are looked ahead for
    # when batched together too
    fixed = [i for i, c in enumerate(cases) if "threshold" not in c and "origin" not in str(c)]
    taken = runner.lookahead_taken
    batched_fixed = [
        _key(o) for o in eng.generate([prompts[i] for i in fixed], [cases[i] for i in fixed])
    ]
    assert runner.lookahead_taken > taken
    assert batched_fixed == [alone[i] for i in fixed]


def test_arrival_joins_a_step_later(looking_ahead: dict[str, Engine]) -> None:
    """A request that arrives while a forward waits ahead does not make it dropped: the
    engine admits it one step later, and its tokens are those it gets alone."""
    eng = looking_ahead["llada"]
    runner = eng.runner
    case = CASES["llada"][0]
    first, second = _prompt(eng, 0), _prompt(eng, 1)
    alone = [_key(eng.generate([p], case)[0]) for p in (first, second)]
    a = eng.add_request(None, first, case)
    outs = []
    for _ in range(3):  # a refresh, then in-block steps: a forward waits ahead now
        outs += eng.step()
    assert runner.holds_lookahead_for(list(eng.scheduler.running))
    taken, dropped = runner.lookahead_taken, runner.lookahead_dropped
    b = eng.add_request(None, second, case)
    outs += eng.step()
    assert runner.lookahead_taken == taken + 1 and runner.lookahead_dropped == dropped
    assert [s.request_id for s in eng.scheduler.running] == [a]  # b joins a step later
    while eng.has_unfinished():
        outs += eng.step()
    final = {o.request_id: _key(o) for o in outs if o.finished}
    assert [final[a], final[b]] == alone


def test_abort_drops_the_forward_ahead(looking_ahead: dict[str, Engine]) -> None:
    """Aborting a row while a forward waits ahead drops it (it was made for rows that no
    longer run); the remaining row's tokens are those it gets alone."""
    eng = looking_ahead["llada"]
    runner = eng.runner
    case = CASES["llada"][0]
    keep_prompt = _prompt(eng, 2)
    alone = _key(eng.generate([keep_prompt], case)[0])
    gone = eng.add_request(None, _prompt(eng, 3), case)
    keep = eng.add_request(None, keep_prompt, case)
    outs = []
    for _ in range(3):
        outs += eng.step()
    assert runner.holds_lookahead_for(list(eng.scheduler.running))
    dropped = runner.lookahead_dropped
    eng.abort(gone)
    while eng.has_unfinished():
        outs += eng.step()
    assert runner.lookahead_dropped > dropped
    final = {o.request_id: o for o in outs if o.finished}
    assert final[gone].finish_reason == "abort"
    assert _key(final[keep]) == alone
