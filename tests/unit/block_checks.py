"""Checks shared by the block-diffusion engine tests (single-block rules and multi_bd)."""

from __future__ import annotations

from collections.abc import Callable

from dlm_engine.engine import Engine

Reference = Callable[[Engine, list[int], dict], list[int]]


def assert_pages_back(engine: Engine) -> None:
    """No row holds a KV page or a reservation: every page is free or idle (cached)."""
    bp = engine.runner.block_pages
    assert not bp.rows, "every finished request gave its pages back"
    pool = bp.pool
    assert pool.reserved == 0 and not any(pool.refs)
    assert pool.available == pool.pages == len(pool.free) + len(pool.idle)


def check_alone_and_batched(
    engine: Engine, pairs: list[tuple[list[int], dict]], reference: Reference, past: int
) -> list[list[int]]:
    """Each (prompt, params) alone and all batched equal `reference`, one forward a step,
    every page back after; some answer is longer than `past` tokens (decodes past a block)."""
    expected = [reference(engine, p, c) for p, c in pairs]
    alone = [engine.generate([p], c)[0].token_ids for p, c in pairs]
    forwards0, steps0 = engine.runner.forward_passes, engine.total_forwards
    batched = engine.generate([p for p, _ in pairs], [c for _, c in pairs])
    assert alone == expected
    assert [o.token_ids for o in batched] == expected
    assert engine.runner.forward_passes - forwards0 == engine.total_forwards - steps0
    assert_pages_back(engine)
    assert any(len(e) > past for e in expected), "the cases must decode past a block"
    return expected
