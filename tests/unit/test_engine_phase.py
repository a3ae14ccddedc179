"""Phase-aligned admission of cached rows: requests that arrive at different times refresh
their caches in the same steps (one forward per step), and their tokens do not change."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dlm_engine import Engine, EngineConfig
from dlm_lab.testing import SAMPLE_PROMPTS

PARAMS = dict(max_tokens=32, steps=16, block_length=8, cache="dual", suppress_eos=True)


def staggered(engine: Engine, gap_steps: int, n: int = 3) -> tuple[list[list[int]], int]:
    """n requests, one every gap_steps steps; (token ids in arrival order, mixed steps)."""
    runner = engine.runner
    prompts = [
        engine.encode_prompt(messages=[{"role": "user", "content": SAMPLE_PROMPTS[i]}])
        for i in range(n)
    ]
    ids, finals, mixed, step = [], {}, 0, 0
    while len(finals) < n:
        if step % gap_steps == 0 and len(ids) < n:
            ids.append(engine.add_request(None, prompts[len(ids)], PARAMS))
        before = (runner.refreshes, runner.span_steps)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
        mixed += runner.refreshes > before[0] and runner.span_steps > before[1]
        step += 1
    return [finals[i] for i in ids], mixed


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_staggered_cached_rows_refresh_together(ckpt_dir: dict[str, Path], family: str) -> None:
    def engine(wait: int) -> Engine:
        return Engine(EngineConfig(model=str(ckpt_dir[family]), max_rows=8, phase_wait_steps=wait))

    free_tokens, free_mixed = staggered(engine(0), gap_steps=3)
    aligned_tokens, aligned_mixed = staggered(engine(8), gap_steps=3)
    alone = engine(0)
    want = [
        alone.generate(
            [alone.encode_prompt(messages=[{"role": "user", "content": SAMPLE_PROMPTS[i]}])],
            PARAMS,
        )[0].token_ids
        for i in range(3)
    ]
    assert free_tokens == want and aligned_tokens == want  # admission never changes tokens
    assert free_mixed > 0  # arriving mid-block, rows drift apart in phase ...
    assert aligned_mixed == 0  # ... unless held until the running rows refresh


def test_a_held_row_waits_at_most_phase_wait_steps(ckpt_dir: dict[str, Path]) -> None:
    eng = Engine(EngineConfig(model=str(ckpt_dir["llada"]), max_rows=8, phase_wait_steps=2))
    p = eng.encode_prompt(messages=[{"role": "user", "content": SAMPLE_PROMPTS[0]}])
    first = eng.add_request(None, p, dict(PARAMS, steps=4, block_length=32))  # 4 steps a block
    eng.step()
    late = eng.add_request(None, p, PARAMS)
    running = []
    for _ in range(3):
        eng.step()
        running.append({s.request_id for s in eng.scheduler.running})
    assert first in running[0]
    assert [late in r for r in running] == [False, False, True]


def _loop_first_step(
    eng: Engine, requests: list[tuple[float, dict]]
) -> tuple[list[int], dict[str, list[int]]]:
    """Submit (delay before it, params) in turn to an EngineLoop; rows of its first step (as
    a list) and each request's token ids."""
    from dlm_engine import EngineLoop

    p = eng.encode_prompt(messages=[{"role": "user", "content": SAMPLE_PROMPTS[0]}])
    rows: list[int] = []
    done: dict[str, list[int]] = {}
    finished = threading.Event()

    def collect(out) -> None:
        if out.finished:
            done[out.request_id] = out.token_ids
            if len(done) == len(requests):
                finished.set()

    loop = EngineLoop(eng, on_step=lambda n: rows.append(n))
    try:
        for i, (delay, params) in enumerate(requests):
            time.sleep(delay)
            loop.submit(f"r{i}", p, eng.resolve_params(params), collect)
        assert finished.wait(120)
    finally:
        loop.shutdown()
    return rows[:1], done


def _alone(eng: Engine) -> list[int]:
    """The tokens of `_loop_first_step`'s request run alone."""
    p = eng.encode_prompt(messages=[{"role": "user", "content": SAMPLE_PROMPTS[0]}])
    return eng.generate([p], PARAMS)[0].token_ids


def test_an_idle_engine_gathers_a_burst_of_cached_rows(ckpt_dir: dict[str, Path]) -> None:
    """Served requests of one burst reach the engine milliseconds apart: the first cached
    row waits for the rest (gap 3 s, window 6 s: only the quiet gap after the last arrival
    ends it, however slow the machine), so all start their first block together; tokens as
    alone."""
    cfg = EngineConfig(
        model=str(ckpt_dir["llada"]), admission_gap_ms=3_000, admission_window_ms=6_000
    )
    eng = Engine(cfg)
    rows, done = _loop_first_step(eng, [(0.0, PARAMS), (0.2, PARAMS), (0.2, PARAMS)])
    assert rows == [3]
    alone = _alone(eng)
    assert done == {"r0": alone, "r1": alone, "r2": alone}


def test_a_burst_tolerates_longer_gaps_than_a_lone_request(ckpt_dir: dict[str, Path]) -> None:
    """Once a second request has come, a stall in the burst up to the burst gap does not end
    the gathering (gap 1 s, burst gap 4 s: the third request, 2 s after the second, still
    joins the first step); a lone request waits only the short gap (the second one, 3 s
    later, misses the first step)."""
    model = str(ckpt_dir["llada"])
    cfg = EngineConfig(
        model=model,
        admission_gap_ms=1_000,
        admission_burst_gap_ms=4_000,
        admission_window_ms=30_000,
    )
    rows, _ = _loop_first_step(Engine(cfg), [(0.0, PARAMS), (0.1, PARAMS), (2.0, PARAMS)])
    assert rows == [3]
    rows, _ = _loop_first_step(Engine(cfg), [(0.0, PARAMS), (3.0, PARAMS)])
    assert rows == [1]


def test_gathering_ends_once_the_waiting_rows_fill_a_step(ckpt_dir: dict[str, Path]) -> None:
    """With max_rows 2 the second request fills the first step: the loop steps at once
    instead of waiting out a 60 s gap (both answers come long before it); tokens as alone."""
    cfg = EngineConfig(
        model=str(ckpt_dir["llada"]),
        max_rows=2,
        admission_gap_ms=60_000,
        admission_burst_gap_ms=60_000,
        admission_window_ms=60_000,
    )
    eng = Engine(cfg)
    start = time.monotonic()
    rows, done = _loop_first_step(eng, [(0.0, PARAMS), (0.1, PARAMS)])
    assert time.monotonic() - start < 50  # a wait for the gap alone would take 60 s
    assert rows == [2]
    alone = _alone(eng)
    assert done == {"r0": alone, "r1": alone}


def test_the_admission_window_caps_the_wait_and_spares_exact_rows(
    ckpt_dir: dict[str, Path],
) -> None:
    """The window bounds the wait even while requests keep coming (gap 10 s, window 0.3 s:
    the later request, sent 2 s after, misses the first step); an exact row never waits for
    a burst (gap and window 60 s: it would not finish in the test's time if it did)."""
    model = str(ckpt_dir["llada"])
    eng = Engine(EngineConfig(model=model, admission_gap_ms=10_000, admission_window_ms=300))
    rows, _ = _loop_first_step(eng, [(0.0, PARAMS), (2.0, PARAMS)])
    assert rows == [1]
    exact = dict(PARAMS, cache="none")
    eng = Engine(EngineConfig(model=model, admission_gap_ms=60_000, admission_window_ms=60_000))
    t = time.monotonic()
    rows, _ = _loop_first_step(eng, [(0.0, exact)])
    assert rows == [1] and time.monotonic() - t < 50
