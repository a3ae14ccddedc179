"""One request never harms another inside a step.

Extreme accepted values of every numeric key (accelerated decoding's too; unbounded ones at
2**62) run in the same steps as good requests; each good request's output equals the same request
run alone. Rows whose step still fails (forced NaN,
an exception in its policy) end alone with a clear error while the others go on.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dlm_engine import Engine, EngineConfig, RequestOutput
from dlm_engine.decoding import proposals
from dlm_lab.testing import SAMPLE_PROMPTS, make_tiny_checkpoint
from dlm_protocol.params import ACCELERATION_PARAMS, FLOAT, INT, Param

MAX_CANVAS = 32
TINY = 1e-300  # the smallest useful value above an exclusive minimum of 0
HUGE = 2**62  # what a key without an upper bound is sent

GOOD = [
    dict(max_tokens=4, steps=4, block_length=4),
    dict(max_tokens=8, steps=4, temperature=0.8, seed=3),
]
# accepted values at the edges of every numeric key's range
EXTREME_COMMON = [
    dict(max_tokens=4, steps=4, temperature=1e-300, seed=1),
    dict(max_tokens=4, steps=4, temperature=2.0, seed=2),
    dict(max_tokens=4, steps=4, alg_temp=1e-300, seed=3),
    dict(max_tokens=4, steps=4, alg_temp=100.0, seed=4),
    dict(max_tokens=4, steps=4, threshold=1e-300),
    dict(max_tokens=4, steps=4, threshold=1.0),
    dict(max_tokens=MAX_CANVAS, steps=1, block_length=MAX_CANVAS, seed=2**63 - 1, temperature=1),
    dict(max_tokens=4, steps=4, block_length=1, seed=0, algorithm="random"),
    dict(max_tokens=1, steps=1),
    # accelerated decoding: max_nfe and max_active_blocks have no upper bound
    dict(max_tokens=4, steps=4, max_nfe=1),
    dict(max_tokens=4, steps=4, max_nfe=HUGE),
    dict(max_tokens=8, block_length=4, multi_block=True, block_add_threshold=0.0,
         decoded_token_threshold=TINY, max_active_blocks=1),
    dict(max_tokens=8, block_length=4, multi_block=True, block_add_threshold=1.0,
         decoded_token_threshold=1.0, max_active_blocks=HUGE),
    dict(max_tokens=8, block_length=4, multi_block=True, threshold=TINY, max_nfe=HUGE,
         max_active_blocks=HUGE),
    dict(max_tokens=8, block_length=4, multi_block=True, threshold=20.0, max_nfe=1,
         seed=2**63 - 1, temperature=2.0),
    # d3LLM's delayed KV cache: cached after one step and refreshed every step, or never
    dict(max_tokens=8, block_length=4, multi_block=True, cache="prefix", cache_delay_iter=1,
         refresh_interval=1),
    dict(max_tokens=8, block_length=4, multi_block=True, cache="prefix", cache_delay_iter=HUGE,
         refresh_interval=HUGE, threshold=TINY),
]  # fmt: skip
EXTREME = {
    "llada": [
        *EXTREME_COMMON,
        dict(max_tokens=4, steps=4, cfg_scale=100.0),
        dict(max_tokens=4, steps=4, cfg_scale=100.0, temperature=2.0, seed=5),
        # LLaDA-only accelerated rules: Fast-dLLM's factor, LocalLeap
        dict(max_tokens=4, steps=4, factor=TINY),
        dict(max_tokens=4, steps=4, factor=100.0, temperature=2.0, seed=11),
        dict(
            max_tokens=8,
            steps=8,
            block_length=4,
            use_local_leap=True,
            anchor_threshold=0.0,
            neighbor_threshold=0.0,
            leap_radius=16,
        ),
        dict(
            max_tokens=8,
            steps=8,
            block_length=4,
            algorithm="local_leap",
            anchor_threshold=1.0,
            neighbor_threshold=1.0,
            leap_radius=1,
            temperature=2.0,
            seed=12,
        ),
        dict(
            max_tokens=8,
            block_length=4,
            multi_block=True,
            algorithm="factor",
            factor=100.0,
            max_active_blocks=HUGE,
        ),
    ],
    "dream": [
        *EXTREME_COMMON,
        dict(max_tokens=4, steps=4, temperature=1e-300, top_p=1e-300, top_k=2**62, seed=5),
        dict(max_tokens=4, steps=4, temperature=1e-300, top_k=1, alg_temp=1e-300, seed=6),
        dict(max_tokens=4, steps=4, algorithm="origin", temperature=2.0, seed=7),
        dict(max_tokens=4, steps=4, algorithm="entropy", alg_temp=1e-300, seed=8),
    ],
}


@pytest.fixture(scope="module", params=["llada", "dream"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    family = request.param
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp(family) / family, family, seed=1)
    return Engine(EngineConfig(model=str(ckpt), max_rows=32, max_canvas=MAX_CANVAS))


def _prompt(eng: Engine, i: int) -> list[int]:
    text = SAMPLE_PROMPTS[i % len(SAMPLE_PROMPTS)]
    return eng.encode_prompt(messages=[{"role": "user", "content": text}])


def _key(o: RequestOutput) -> tuple:
    return (o.token_ids, o.text, o.finish_reason, o.steps, o.error)


_ALONE: dict[str, list[tuple]] = {}


def _alone(eng: Engine) -> list[tuple]:
    """The good requests' outputs, each run alone (once per engine)."""
    if eng.family.name not in _ALONE:
        outs = [eng.generate([_prompt(eng, i)], p)[0] for i, p in enumerate(GOOD)]
        _ALONE[eng.family.name] = [_key(o) for o in outs]
    return _ALONE[eng.family.name]


def test_extreme_values_beside_good_requests(engine: Engine) -> None:
    alone = _alone(engine)
    extreme = EXTREME[engine.family.name]
    prompts = [_prompt(engine, i) for i in range(len(GOOD) + len(extreme))]
    outs = engine.generate(prompts, [*GOOD, *extreme])
    assert [_key(o) for o in outs[: len(GOOD)]] == alone
    for params, out in zip(extreme, outs[len(GOOD) :], strict=True):
        assert out.finished and out.error is None, (params, out.error)
        assert out.finish_reason in ("stop", "length"), params


def _edges(param: Param) -> set[float]:
    """The extreme accepted values of a numeric key: its bounds (TINY above an exclusive
    minimum of 0, HUGE for no maximum)."""
    assert param.minimum is not None, param.name
    low = param.minimum + TINY if param.exclusive_minimum else param.minimum
    return {low, HUGE if param.maximum is None else param.maximum}


def test_extremes_cover_every_acceleration_key() -> None:
    """Each numeric key of accelerated decoding runs at both ends of its range above (a key
    added to the contract without extreme cases here fails this test)."""
    numeric = [p for p in ACCELERATION_PARAMS if p.kind in (INT, FLOAT)]
    assert numeric
    sent: dict[str, set[float]] = {}
    for case in (c for cases in EXTREME.values() for c in cases):
        for key, value in case.items():
            sent.setdefault(key, set()).add(value)
    for param in numeric:
        missing = _edges(param) - sent.get(param.name, set())
        assert not missing, f"{param.name}: no extreme case for {missing}"
        for value in _edges(param):
            assert param.check(value) == value  # accepted, not clamped by the contract


def test_non_finite_row_fails_alone(engine: Engine) -> None:
    """A row that makes NaN (the numeric floors bypassed) ends with an error; the others
    finish exactly as alone, in the same steps."""
    alone = _alone(engine)
    bad = engine.resolve_params(dict(max_tokens=4, steps=4, alg_temp=0.5, seed=1))
    bad = replace(bad, alg_temp=1e-320)  # what the floor prevents: c / alg_temp overflows
    ids = [engine.add_request(None, _prompt(engine, i), p) for i, p in enumerate(GOOD)]
    bad_id = engine.add_request(None, _prompt(engine, 5), bad)
    final = {o.request_id: o for o in engine.outputs() if o.finished}
    assert [_key(final[i]) for i in ids] == alone
    assert final[bad_id].finish_reason == "error"
    assert "non-finite" in final[bad_id].error


def test_exception_in_a_rows_policy_fails_that_row_only(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _alone(engine)
    poison = 0.123  # a temperature only the faulty row uses
    real_gumbel, real_multinomial = proposals._gumbel_argmax, proposals._multinomial

    def gumbel(lg, temperature, generator):
        if temperature == poison:
            raise RuntimeError("policy exploded")
        return real_gumbel(lg, temperature, generator)

    def multinomial(p, generator):
        if generator is faulty_generator[0]:
            raise RuntimeError("policy exploded")
        return real_multinomial(p, generator)

    faulty_generator: list = [None]
    monkeypatch.setattr(proposals, "_gumbel_argmax", gumbel)
    monkeypatch.setattr(proposals, "_multinomial", multinomial)
    ids = [engine.add_request(None, _prompt(engine, i), p) for i, p in enumerate(GOOD)]
    bad_id = engine.add_request(
        None, _prompt(engine, 4), dict(max_tokens=4, steps=4, temperature=poison, seed=9)
    )
    faulty_generator[0] = next(
        s.generator for s in engine.scheduler.waiting if s.request_id == bad_id
    )
    final = {o.request_id: o for o in engine.outputs() if o.finished}
    assert [_key(final[i]) for i in ids] == alone
    assert final[bad_id].finish_reason == "error"
    assert "policy exploded" in final[bad_id].error


def test_rejected_values_name_their_field(engine: Engine) -> None:
    for key, value in [
        ("cfg_scale", 1e300),
        ("temperature", 2.5),
        ("alg_temp", 1e300),
        ("alg_temp", -1),
    ]:
        with pytest.raises(ValueError, match=f"invalid request: {key}:"):
            engine.resolve_params({key: value})
