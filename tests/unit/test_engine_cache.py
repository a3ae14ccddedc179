"""Cached mode (prefix / dual KV caches refreshed at block starts)."""

from __future__ import annotations

import pytest
import torch

from dlm_engine import Engine
from dlm_engine.sequence import Sequence
from dlm_lab.testing import SAMPLE_PROMPTS


def _prompt(eng: Engine, i: int = 0) -> list[int]:
    return eng.encode_prompt(messages=[{"role": "user", "content": SAMPLE_PROMPTS[i]}])


@pytest.mark.parametrize("name", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_one_step_per_block_equals_exact(engines: dict[str, Engine], name: str, cache: str) -> None:
    """With one step per block every step is a refresh, so cached mode is exact."""
    eng = engines[name]
    p = _prompt(eng)
    base = dict(max_tokens=32, steps=4, block_length=8)
    exact = eng.generate([p], base)[0]
    cached = eng.generate([p], dict(base, cache=cache))[0]
    assert cached.token_ids == exact.token_ids


def _mid_block_rows(eng: Engine, name: str, cache: str, tag: str) -> list[Sequence]:
    """Rows of two lengths at the start of their second block (committed text before it)."""
    seqs = []
    for i, n in enumerate((24, 32)):
        params = eng.resolve_params(dict(max_tokens=n, steps=n, block_length=8, cache=cache))
        seq = Sequence(
            f"{name}-{cache}-{tag}-{i}",
            _prompt(eng, i),
            params,
            family=name,
            mask_id=eng.mask_id,
            device=eng.runner.device,
        )
        seq.block = 1
        seq.tokens[seq.prompt_len : seq.window_start] = torch.arange(8) + 10
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("name", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_span_forward_on_fresh_cache_equals_full_forward(
    engines: dict[str, Engine], name: str, cache: str
) -> None:
    """Right after a refresh (tokens unchanged) the span forward reads exactly what a full
    forward would compute: same logits for the window, so positions, masks, shift and
    cache writes line up. Exact rows in a pooled step read only their own fresh keys."""
    eng = engines[name]
    runner = eng.runner
    seqs = _mid_block_rows(eng, name, cache, "a")
    exact_rows = _mid_block_rows(eng, name, "none", "b")
    try:
        full, cur_full = runner._window_logits(seqs)  # step_in_block 0: refresh
        for s in seqs:
            s.step_in_block = 1
        span, cur_span = runner._window_logits(seqs)  # inside the block: span over the cache
        exact, _ = runner._window_logits(exact_rows)  # no cached row: no pool
        for s in seqs:  # the pooled exact rows beside the span rows
            s.step_in_block = 0
        both, _ = runner._window_logits(exact_rows + seqs)
    finally:
        for s in seqs + exact_rows:
            runner.release(s.request_id)
    torch.testing.assert_close(full, exact)
    torch.testing.assert_close(span, full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both, torch.cat([exact, full]))
    assert torch.equal(cur_full, cur_span)


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_mixed_phase_step_is_one_forward(engines: dict[str, Engine], name: str) -> None:
    """Exact rows, cached rows at a block start and cached rows inside a block go through the
    model as one packed forward, and each row's logits equal its own forward alone."""
    eng = engines[name]
    runner = eng.runner
    exact = _mid_block_rows(eng, name, "none", "x")[:1]
    refresh = _mid_block_rows(eng, name, "dual", "r")[:1]
    span = _mid_block_rows(eng, name, "prefix", "s")
    try:
        for s in span:  # refresh their caches, then step inside the block
            runner._window_logits([s])
            s.step_in_block = 1
        alone = [runner._window_logits([s])[0] for s in exact + refresh + span]
        for s in refresh:
            s.step_in_block = 0
        before = runner.forward_passes
        mixed, _ = runner._window_logits(exact + refresh + span)
        assert runner.forward_passes == before + 1
    finally:
        for s in exact + refresh + span:
            runner.release(s.request_id)
    for i, logits in enumerate(alone):
        torch.testing.assert_close(mixed[i], logits[0], rtol=1e-4, atol=1e-4)


def test_refreshes_once_per_block_and_frees_slots(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    r = eng.runner
    before_refresh, before_span = r.refreshes, r.span_steps
    out = eng.generate(
        [_prompt(eng)],
        dict(max_tokens=32, steps=16, block_length=8, cache="dual", suppress_eos=True),
    )[0]
    assert out.steps == 16
    assert r.refreshes - before_refresh == 4  # one per block
    assert r.span_steps - before_span == 12  # the other steps of each block
    assert not r.slots and len(r.pool.free) == r.pool.rows
    k0 = r.pool.k[0]
    a = eng.loaded.model.arch
    assert k0.shape == (
        eng.config.max_rows + 1,
        r.pool.length + 1,
        a.n_kv_heads,
        a.d_model // a.n_heads,
    )


def test_cached_rows_batched_equal_alone(engines: dict[str, Engine]) -> None:
    """Cached, exact and differently-phased rows share steps without changing each other."""
    eng = engines["dream"]
    cases = [
        dict(max_tokens=32, steps=16, block_length=8, cache="dual"),
        dict(max_tokens=24, steps=12, block_length=8, cache="prefix"),
        dict(max_tokens=16, steps=16),
        dict(max_tokens=32, steps=32, block_length=16, cache="dual", threshold=0.3),
    ]
    prompts = [_prompt(eng, i % 4) for i in range(len(cases))]
    alone = [eng.generate([p], c)[0].token_ids for p, c in zip(prompts, cases, strict=True)]
    final = {}
    eng.add_request("r0", prompts[0], cases[0])
    eng.add_request("r1", prompts[1], cases[1])
    for _ in range(3):  # the others join mid-block of r0 and r1
        final.update({o.request_id: o for o in eng.step() if o.finished})
    eng.add_request("r2", prompts[2], cases[2])
    eng.add_request("r3", prompts[3], cases[3])
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert [final[f"r{i}"].token_ids for i in range(4)] == alone


def test_cache_with_cfg_rejected(engines: dict[str, Engine]) -> None:
    from dlm_engine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="cache"):
        engines["llada"].resolve_params(dict(cache="dual", cfg_scale=1.0))
