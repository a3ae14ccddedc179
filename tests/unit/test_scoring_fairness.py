"""Scoring shares the engine's steps fairly with generation (dlm_engine/scoring.py).

A scoring request with many Monte-Carlo samples of a long text used to run a forward of 8 x its
length in every step, so a generation neighbour paid that in each of its own steps. These tests
count what every forward feeds (tokens, not seconds): beside generation rows scoring feeds at
most half the tokens they do, no forward exceeds `score_step_tokens` (one text at least), a
request arriving while scoring runs alone gets its first step without a scoring forward, and
the estimate is the same however the samples are cut into forwards and whoever runs beside.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import dlm_engine.engine as engine_module
from dlm_engine import Engine, EngineConfig, InvalidRequestError, RequestOutput
from dlm_engine.scoring import ScoreJob, ScoringQueue
from dlm_triton.backend.settings import resolve_settings

GEN = {"max_tokens": 16, "steps": 16, "temperature": 0.8, "seed": 5}
LONG_GEN = {**GEN, "max_tokens": 32, "steps": 32}


def _engine(ckpt_dir: dict[str, Path], family: str = "llada", **config) -> Engine:
    return Engine(EngineConfig(model=str(ckpt_dir[family]), max_rows=8, **config))


def _text(eng: Engine, length: int) -> list[int]:
    ids = eng.tokenizer.encode(
        "The cat sat on the mat. " * (length // 20 + 1), add_special_tokens=False
    )
    return ids[:length]


class _Ledger:
    """Tokens each scoring forward fed (the real forward runs; it is only counted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tokens: list[int] = []
        real = engine_module.run_chunk

        def counted(job: ScoreJob, model, mask_id, device, rows: int) -> None:
            self.tokens.append(rows * len(job.ids))
            real(job, model, mask_id, device, rows)

        monkeypatch.setattr(engine_module, "run_chunk", counted)


def _generation_tokens(eng: Engine) -> int:
    """Tokens the next step's generation forward feeds: every row running or waiting (the
    tests' few rows all fit one step)."""
    return sum(s.step_tokens * s.rows for s in (*eng.scheduler.running, *eng.scheduler.waiting))


def _run_until(eng: Engine, rid: str) -> tuple[RequestOutput, int]:
    """Step until `rid` finishes: its final output and the steps taken."""
    steps = 0
    while True:
        steps += 1
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out, steps


def test_a_neighbour_keeps_its_pace_beside_hostile_scoring(
    ckpt_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = _engine(ckpt_dir)
    prompt = eng.encode_prompt(messages=[{"role": "user", "content": "abc"}])
    eng.add_request("alone", prompt, LONG_GEN)
    t0 = time.monotonic()
    alone, alone_steps = _run_until(eng, "alone")
    alone_s = time.monotonic() - t0

    ledger = _Ledger(monkeypatch)
    ids = _text(eng, 600)
    eng.add_request("hostile", ids, {"score": True, "mc_samples": 1024, "seed": 1})
    for _ in range(3):  # scoring alone: one forward a step, each within the budget
        eng.step()
    assert len(ledger.tokens) == 3 and max(ledger.tokens) <= eng.config.score_tokens
    ledger.tokens.clear()

    eng.add_request("n", prompt, LONG_GEN)
    generation_tokens = 0
    steps = 0
    t0 = time.monotonic()
    final = None
    while final is None:
        steps += 1
        generation_tokens += _generation_tokens(eng)
        final = next((o for o in eng.step() if o.request_id == "n" and o.finished), None)
    beside_s = time.monotonic() - t0
    print(
        f"\nneighbour: {alone_steps} steps alone, {steps} beside scoring; generation fed "
        f"{generation_tokens} tokens, scoring {sum(ledger.tokens)} (before sharing: "
        f"{8 * len(ids)} a step); wall {alone_s:.3f}s alone, {beside_s:.3f}s beside"
    )
    assert final.token_ids == alone.token_ids
    assert steps == alone_steps  # it never waits a step for scoring
    # its steps' forwards plus the scoring forwards beside them: at most 1.5x its own, and
    # scoring still advanced
    assert 0 < 2 * sum(ledger.tokens) <= generation_tokens + steps
    assert max(ledger.tokens, default=0) <= eng.config.score_tokens
    eng.abort("hostile")
    assert [o.finish_reason for o in eng.step()] == ["abort"]


def test_arrival_mid_scoring_waits_for_no_new_scoring_forward(
    ckpt_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = _engine(ckpt_dir, score_step_tokens=256)
    ledger = _Ledger(monkeypatch)
    ids = _text(eng, 300)  # longer than the budget: one text a forward
    eng.add_request("s", ids, {"score": True, "mc_samples": 64, "seed": 1})
    for _ in range(4):
        eng.step()
    assert ledger.tokens == [300] * 4 and eng.total_forwards == 4
    prompt = eng.encode_prompt(messages=[{"role": "user", "content": "abc"}])
    eng.add_request("n", prompt, GEN)
    eng.step()
    assert eng.total_forwards == 5 and len(ledger.tokens) == 4  # the neighbour's forward only
    eng.abort("s")
    eng.abort("n")
    eng.step()


def test_scoring_finishes_beside_steady_generation_with_the_same_estimate(
    ckpt_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = _engine(ckpt_dir, score_step_tokens=128)
    ids = _text(eng, 96)
    params = {"score": True, "mc_samples": 16, "seed": 4}
    eng.add_request("alone", ids, params)
    alone, _ = _run_until(eng, "alone")

    ledger = _Ledger(monkeypatch)
    prompt = eng.encode_prompt(messages=[{"role": "user", "content": "abc"}])
    eng.add_request("s", ids, params)
    finished = None
    steps = generation_tokens = started = 0
    while finished is None:  # a neighbour always runs: a new one as each ends
        if not eng.scheduler.running and not eng.scheduler.waiting:
            eng.add_request(f"g{started}", prompt, GEN)
            started += 1
        generation_tokens += _generation_tokens(eng)
        steps += 1
        finished = next((o for o in eng.step() if o.request_id == "s"), None)
    assert finished.score == alone.score and finished.logprobs == alone.logprobs
    assert finished.steps == alone.steps == 16  # one text (96 tokens) a forward
    assert 2 * sum(ledger.tokens) == 2 * 16 * 96 <= generation_tokens + steps
    assert sum(ledger.tokens) <= 128 * steps  # at most score_step_tokens a step on average
    for seq in eng.scheduler.running:
        eng.abort(seq.request_id)
    eng.step()
    assert not eng.has_unfinished()


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cutting_batches_into_forwards_leaves_the_estimate_unchanged(
    ckpt_dir: dict[str, Path], family: str
) -> None:
    """A whole batch of 8 samples in one forward (what scoring did before it was shared) and
    the same draws cut into forwards of 1 or 3 texts give the same numbers."""
    results = {}
    for budget in (65_536, 200, 600):
        eng = _engine(ckpt_dir, family, score_step_tokens=budget)
        ids = _text(eng, 200)
        eng.add_request("s", ids, {"score": True, "mc_samples": 20, "seed": 9})
        results[budget], _ = _run_until(eng, "s")
    whole, single, three = results[65_536], results[200], results[600]
    assert (whole.steps, single.steps, three.steps) == (3, 20, 8)  # 8+8+4; 1 each; 3+3+2, 3+1
    for cut in (single, three):
        assert cut.score["mc_samples"] == 20
        assert cut.score["log_likelihood"] == pytest.approx(whole.score["log_likelihood"], rel=1e-6)
        assert cut.score["variance"] == pytest.approx(whole.score["variance"], rel=1e-6)
        for a, b in zip(cut.logprobs, whole.logprobs, strict=True):
            assert a["token"] == b["token"]
            assert (a["logprob"] is None) == (b["logprob"] is None)
            if a["logprob"] is not None:
                assert a["logprob"] == pytest.approx(b["logprob"], rel=1e-6, abs=1e-9)


def test_scoring_priority_orders_scoring_requests_only(
    ckpt_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = _engine(ckpt_dir, score_step_tokens=64)
    ids = _text(eng, 40)
    eng.add_request("late", ids, {"score": True, "mc_samples": 8, "seed": 1})
    eng.add_request("urgent", ids, {"score": True, "mc_samples": 8, "seed": 1, "priority": -5})
    order = [o.request_id for o in eng.outputs() if o.finished]
    assert order == ["urgent", "late"]

    # an urgent scoring request still ranks below generation rows
    ledger = _Ledger(monkeypatch)
    prompt = eng.encode_prompt(messages=[{"role": "user", "content": "abc"}])
    eng.add_request("n", prompt, {**GEN, "priority": 10})
    eng.add_request("s", _text(eng, 600), {"score": True, "mc_samples": 64, "priority": -100})
    generation_tokens = steps = 0
    while "n" in eng.scheduler:
        generation_tokens += _generation_tokens(eng)
        steps += 1
        eng.step()
    assert 2 * sum(ledger.tokens) <= generation_tokens + steps
    eng.abort("s")
    eng.step()


def test_limits_are_400s_naming_the_field(ckpt_dir: dict[str, Path]) -> None:
    eng = _engine(ckpt_dir, max_prompt=128)
    with pytest.raises(InvalidRequestError) as err:
        eng.resolve_params({"score": True, "mc_samples": 1025})
    assert err.value.field == "mc_samples"
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(None, _text(eng, 129), {"score": True})
    assert err.value.field == "prompt" and "limit is 128" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        eng.encode_prompt(text="x" * 129)
    assert err.value.field == "text_input"


def test_the_setting(ckpt_dir: dict[str, Path]) -> None:
    assert EngineConfig(model="x").score_tokens == 65_536 // 64
    assert EngineConfig(model="x", max_step_tokens=4096).score_tokens == 64
    assert EngineConfig(model="x", max_step_tokens=10).score_tokens == 1
    assert EngineConfig(model="x", score_step_tokens=300).score_tokens == 300
    with pytest.raises(ValueError, match="score_step_tokens"):
        EngineConfig(model="x", score_step_tokens=-1)
    s = resolve_settings({"checkpoint": "x", "score_step_tokens": "512"}, environ={})
    assert s.score_step_tokens == 512
    env = resolve_settings({"checkpoint": "x"}, environ={"DLM_SCORE_STEP_TOKENS": "2048"})
    assert env.score_step_tokens == 2048
    assert not resolve_settings({"checkpoint": "x"}, environ={}).configured("score_step_tokens")
    with pytest.raises(ValueError, match="score_step_tokens"):
        resolve_settings({"checkpoint": "x", "score_step_tokens": "lots"}, environ={})


def test_scoring_banks_at_most_one_chunk() -> None:
    """Long generation steps do not let scoring save up a burst of forwards for later."""
    queue = ScoringQueue(step_tokens=100, vocab=50)
    queue.add(ScoreJob("s", list(range(30)), 64, torch.Generator(), 0))
    assert queue.next_chunk()[1] == 3  # 100 // 30 texts a forward: 90 tokens
    for _ in range(50):
        queue.earn(10_000)  # big generation steps: at most 100 a step, banked up to 100
    assert queue.credit == 100
    assert queue.take_turn(generation_busy=True) is not None and queue.credit == 10
    assert queue.take_turn(generation_busy=True) is None  # one chunk, then earn again
    queue.earn(1)
    assert queue.credit == 11  # half of 1, rounded up
    assert queue.take_turn(generation_busy=False) is not None and queue.credit == 0

    long = ScoringQueue(step_tokens=100, vocab=50)
    long.add(ScoreJob("l", list(range(250)), 8, torch.Generator(), 0))
    for _ in range(10):
        long.earn(120)  # 60 a step
    assert long.credit == 250  # a text longer than the budget: banked up to that one text
    assert long.take_turn(generation_busy=True) == (long.jobs[0], 1) and long.credit == 0
    assert long.remove("l") is not None and long.credit == 0 and not long


def test_a_row_that_cannot_join_does_not_stall_scoring(ckpt_dir: dict[str, Path]) -> None:
    """Scoring yields to rows that run, not to rows that wait: one whose KV pages never come
    free (reserve refuses it) leaves scoring running a forward every step."""
    eng = _engine(ckpt_dir)
    eng.scheduler.reserve = lambda seq: False
    prompt = eng.encode_prompt(messages=[{"role": "user", "content": "abc"}])
    eng.add_request("stuck", prompt, GEN)
    ids = _text(eng, 40)
    eng.add_request("s", ids, {"score": True, "mc_samples": 16, "seed": 1})
    out, steps = _run_until(eng, "s")
    assert out.score["mc_samples"] == 16 and steps == out.steps == 2
    assert "stuck" in eng.scheduler and not eng.scheduler.running
    eng.abort("stuck")
    assert [o.finish_reason for o in eng.step()] == ["abort"]
