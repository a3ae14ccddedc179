"""Step-level continuous batching: rows of different lengths and settings do not affect each other."""

from __future__ import annotations

from dlm_engine import Engine, RequestOutput
from dlm_lab.testing import SAMPLE_PROMPTS as PROMPTS
from dlm_lab.testing import EagerGraphs

MIXED_LLADA = [
    dict(max_tokens=32, steps=32, block_length=8),
    dict(max_tokens=16, steps=8, block_length=16),
    dict(max_tokens=24, steps=24, block_length=8, algorithm="random", seed=7),
    dict(max_tokens=32, steps=32, threshold=0.5),
    dict(max_tokens=16, steps=16, temperature=0.8, seed=123),
    dict(max_tokens=16, steps=8, block_length=4, cfg_scale=1.0),
    dict(max_tokens=32, steps=16, block_length=16, algorithm="entropy"),
]
MIXED_DREAM = [
    dict(max_tokens=32, steps=32),
    dict(max_tokens=16, steps=10, algorithm="maskgit_plus"),
    dict(max_tokens=24, steps=24, algorithm="topk_margin"),
    dict(max_tokens=32, steps=32, threshold=0.3),
    dict(max_tokens=16, steps=16, temperature=0.7, top_p=0.9, seed=5),
    dict(max_tokens=16, steps=16, algorithm="origin", seed=9),
    dict(max_tokens=16, steps=16, alg_temp=0.5, seed=11, top_k=20),
]


def _prompts(eng: Engine, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))
        out.append(eng.encode_prompt(messages=[{"role": "user", "content": text}]))
    return out


def _key(o: RequestOutput) -> tuple:
    return (o.token_ids, o.text, o.finish_reason, o.steps, o.completion_tokens)


def _check_batched_equals_alone(eng: Engine, cases: list[dict]) -> None:
    prompts = _prompts(eng, len(cases))
    alone = [_key(eng.generate([p], c)[0]) for p, c in zip(prompts, cases, strict=False)]
    batched = [_key(o) for o in eng.generate(prompts, cases)]
    assert batched == alone


def test_llada_batched_equals_alone(engines: dict[str, Engine]) -> None:
    _check_batched_equals_alone(engines["llada"], MIXED_LLADA)


def test_dream_batched_equals_alone(engines: dict[str, Engine]) -> None:
    _check_batched_equals_alone(engines["dream"], MIXED_DREAM)


def test_seeded_sampling_reproducible_and_seed_sensitive(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    p = _prompts(eng, 1)[0]
    params = dict(max_tokens=32, steps=32, temperature=1.0, seed=42)
    a = eng.generate([p], params)[0].token_ids
    b = eng.generate([p], params)[0].token_ids
    c = eng.generate([p], dict(params, seed=43))[0].token_ids
    assert a == b
    assert a != c


def test_join_and_leave_mid_flight(engines: dict[str, Engine]) -> None:
    """A request joining after others started, and others leaving early, changes nothing."""
    eng = engines["llada_eos"]
    prompts = _prompts(eng, 3)
    cases = [
        dict(max_tokens=64, steps=64, block_length=8),
        dict(max_tokens=32, steps=32),
        dict(max_tokens=16, steps=16),
    ]
    alone = [_key(eng.generate([p], c)[0]) for p, c in zip(prompts, cases, strict=False)]
    final: dict[str, RequestOutput] = {}
    eng.add_request("a", prompts[0], cases[0])
    for _ in range(3):
        final.update({o.request_id: o for o in eng.step() if o.finished})
    eng.add_request("b", prompts[1], cases[1])
    for _ in range(5):
        final.update({o.request_id: o for o in eng.step() if o.finished})
    eng.add_request("c", prompts[2], cases[2])
    final.update({o.request_id: o for o in eng.outputs() if o.finished})
    assert [_key(final[r]) for r in "abc"] == alone


def test_rows_per_step_respects_max_rows(engines: dict[str, Engine]) -> None:
    eng = engines["dream"]
    prompts = _prompts(eng, 11)
    ids = [eng.add_request(None, p, dict(max_tokens=8, steps=8)) for p in prompts]
    seen = []
    done = set()
    while eng.has_unfinished():
        done |= {o.request_id for o in eng.step() if o.finished}
        seen.append(eng.last_step_rows)
    assert max(seen) == eng.config.max_rows
    assert done == set(ids)


def test_streamed_deltas_concatenate_to_final_text(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    p = _prompts(eng, 1)[0]
    eng.add_request("s", p, dict(max_tokens=32, steps=32, block_length=8, stream_mode="denoise"))
    deltas, canvases, last = [], [], None
    while eng.has_unfinished():
        for o in eng.step():
            deltas.append(o.delta_text)
            canvases.append(o.canvas)
            last = o
    assert last is not None and last.finished
    assert "".join(deltas) == last.text
    assert len(canvases) == last.steps  # one snapshot per step in denoise mode
    assert canvases[0].count(None) == 31 and canvases[-1].count(None) == 0
    assert all(len(c) == 32 for c in canvases)


def test_threshold_commits_several_tokens_per_step(engines: dict[str, Engine]) -> None:
    eng = engines["dream"]
    p = _prompts(eng, 1)[0]
    out = eng.generate([p], dict(max_tokens=32, steps=32, threshold=0.05))[0]
    full = eng.generate([p], dict(max_tokens=32, steps=32, threshold=1.0))[0]
    assert out.steps < 32
    assert full.steps == 32 or full.finish_reason == "stop"  # τ = 1: one token per step


def test_stop_strings_cut_text(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    p = _prompts(eng, 1)[0]
    base = eng.generate([p], dict(max_tokens=32, steps=32, block_length=8))[0]
    assert len(base.text) > 6
    stop = base.text[3:5]
    cut = eng.generate([p], dict(max_tokens=32, steps=32, block_length=8, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.index(stop)]
    assert cut.steps <= base.steps


CACHED_LLADA = [
    dict(max_tokens=32, steps=16, block_length=8, cache="dual"),
    dict(max_tokens=32, steps=16, block_length=8, cache="dual", threshold=0.5),
    dict(max_tokens=32, steps=16, block_length=8, cache="dual", algorithm="entropy"),
    dict(max_tokens=24, steps=12, block_length=8, cache="prefix"),
    dict(max_tokens=16, steps=16, block_length=8),
]
CACHED_DREAM = [
    dict(max_tokens=32, steps=16, block_length=8, cache="dual"),
    dict(max_tokens=32, steps=16, block_length=8, cache="dual", algorithm="topk_margin"),
    dict(max_tokens=32, steps=16, block_length=8, cache="dual", threshold=0.3),
    dict(max_tokens=16, steps=16),
]


def test_graph_bucket_padding_changes_no_token(engines: dict[str, Engine]) -> None:
    """On CUDA every plan is padded to its graph bucket: pad rows, query widths rounded to 32,
    packed tails (an in-block step of 3 cached rows runs as 4 rows of 32 queries). Turned on
    here on CPU, batched and padded equals each request alone and unpadded."""
    for family, cases in (("llada", CACHED_LLADA), ("dream", CACHED_DREAM)):
        eng = engines[family]
        prompts = _prompts(eng, len(cases))
        alone = [_key(eng.generate([p], c)[0]) for p, c in zip(prompts, cases, strict=True)]
        runner = eng.runner
        graphs = EagerGraphs()
        runner.graphs, runner.length_multiple = graphs, 32
        try:
            padded = [_key(o) for o in eng.generate(prompts, cases)]
            in_phase = [_key(o) for o in eng.generate(prompts[:3], cases[:3])]
        finally:
            runner.graphs, runner.length_multiple = None, 1
        assert padded == alone, family
        assert in_phase == alone[:3], family
        # the in-block steps of 3 rows ran as 4 rows of 32 queries: 128 packed tokens
        span3 = {"ids": (1, 128), "span_slots": (4,)}.items()
        assert any(span3 <= shapes.items() for shapes in graphs.shapes), family


def test_in_block_steps_of_one_width_need_no_gather(engines: dict[str, Engine]) -> None:
    """With bucketing on (as on CUDA) and the block as wide as the query multiple, an
    in-block step of rows in pool slots 0..n-1 is one shape with no gather at all: the packed
    order is the padded order (no query index) and keys are read as a view of the pool
    (`GroupLayout.slots_in_place`), alone (1 row of 8 queries: not padded to a longer packed
    length) and for 4 rows. Tokens equal the unbucketed run."""
    eng = engines["llada"]
    case = dict(max_tokens=32, steps=16, block_length=8, cache="dual")
    prompts = _prompts(eng, 4)
    alone = [_key(eng.generate([p], case)[0]) for p in prompts]
    runner = eng.runner
    graphs = EagerGraphs()
    runner.graphs, runner.length_multiple = graphs, 8
    try:
        bucketed = [_key(eng.generate([p], case)[0]) for p in prompts]
        batched = [_key(o) for o in eng.generate(prompts, [case] * 4)]
    finally:
        runner.graphs, runner.length_multiple = None, 1
    assert bucketed == alone and batched == alone
    spans = [
        (key[-1][0], shapes)
        for key, shapes in zip(graphs.keys, graphs.shapes, strict=True)
        if [g.group for g in key[-1]] == ["span"]
    ]
    for rows in (1, 4):
        group, shapes = next((g, s) for g, s in spans if g.rows == rows)
        assert group.identity and group.slots_in_place, rows
        assert shapes["ids"] == (1, rows * 8) and "span_q_index" not in shapes, rows
        assert "out_index" not in shapes, rows


def test_rows_read_their_slots_in_place_in_any_order(engines: dict[str, Engine]) -> None:
    """Rows whose pool slots are out of order (a row left, a later one took its slot) are laid
    out at their own slots and read the pool as a view, with bucketing on as on CUDA: the
    in-block layout is in place but not the packed order, and every row's tokens equal its
    run alone."""
    eng = engines["llada"]
    short = dict(max_tokens=8, steps=4, block_length=8, cache="dual")
    case = dict(max_tokens=32, steps=16, block_length=8, cache="dual")
    prompts = _prompts(eng, 4)
    alone = [_key(eng.generate([p], case)[0]) for p in prompts[1:]]
    runner = eng.runner
    graphs = EagerGraphs()
    runner.graphs, runner.length_multiple = graphs, 8
    try:
        first = eng.add_request(None, prompts[0], short)  # slot 0, leaves after one block
        ids = [eng.add_request(None, p, case) for p in prompts[1:3]]  # slots 1 and 2
        outs = []
        while first in eng.scheduler:
            outs += eng.step()
        ids.append(eng.add_request(None, prompts[3], case))  # takes slot 0
        while ids[-1] not in runner.slots:
            outs += eng.step()
        assert [runner.slots[i] for i in ids] == [1, 2, 0]  # running order is not slot order
        while eng.has_unfinished():
            outs += eng.step()
    finally:
        runner.graphs, runner.length_multiple = None, 1
    final = {o.request_id: _key(o) for o in outs if o.finished}
    assert [final[i] for i in ids] == alone
    assert sorted(runner.slots.get(i, -1) for i in ids) == [-1, -1, -1]  # all released
    spans = [key[-1][0] for key in graphs.keys if [g.group for g in key[-1]] == ["span"]]
    assert any(g.slots_in_place and not g.identity and g.rows == 4 for g in spans)


def test_reused_plans_change_no_token(engines: dict[str, Engine], monkeypatch) -> None:
    """A step whose rows did not move (cached rows inside a block) reuses the last step's
    index tensors and feeds only new tokens (dlm_engine/ragged.py `plan_key`): the same
    tokens as planning every step afresh, alone and batched with unlike rows."""
    import dlm_engine.model_runner as model_runner

    for family, cases in (("llada", CACHED_LLADA), ("dream", CACHED_DREAM)):
        eng = engines[family]
        prompts = _prompts(eng, len(cases))
        reuses = eng.runner.plan_reuses
        reused = [_key(o) for o in eng.generate(prompts, cases)]
        assert eng.runner.plan_reuses > reuses, family  # in-block steps did reuse their plan
        with monkeypatch.context() as m:
            m.setattr(model_runner, "plan_key", lambda queries: None)
            planned = [_key(o) for o in eng.generate(prompts, cases)]
        assert reused == planned, family
