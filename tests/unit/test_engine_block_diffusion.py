"""The engine's block-diffusion path equals the plain no-cache restatements of the
published loops (dlm_lab/reference_block.py) token for token at temperature 0: each
request alone, and all of them in one batch with unlike prompts, blocks, steps and rules.

The engine decodes over an exact KV cache of finished blocks and feeds each step only the
active block (plus, once, the block just finished); the reference forwards the whole
sequence up to the block's end every step. Equal tokens mean the cache is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from block_checks import assert_pages_back, check_alone_and_batched

from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_engine.errors import InvalidRequestError
from dlm_lab import testing

PROMPTS = ["Hello there", "abc", "What is 2+2? Tell me more.", "x"]
SDAR_CASES = [
    {"max_tokens": 13, "block_length": 4, "steps": 4},  # dynamic, threshold 0.85 (defaults)
    {"max_tokens": 16, "block_length": 4, "steps": 2, "algorithm": "low_confidence_static"},
    {"max_tokens": 12, "block_length": 8, "steps": 4, "algorithm": "sequential"},
    {"max_tokens": 10, "block_length": 4, "algorithm": "entropy_bounded", "threshold": 2.0},
    # SDAR's budget binds: one commit a forward, steps + 1 = block_length forwards a block
    {
        "max_tokens": 8,
        "block_length": 4,
        "steps": 3,
        "algorithm": "entropy_bounded",
        "threshold": 1e-9,
    },
    {"max_tokens": 20, "block_length": 8, "steps": 8, "threshold": 0.3},
]
LLADA2_CASES = [
    {"max_tokens": 16, "block_length": 8, "steps": 8},  # threshold 0.95 (LLaDA2's default)
    {"max_tokens": 12, "block_length": 4, "steps": 2, "threshold": 0.2},
    {"max_tokens": 9, "block_length": 8, "steps": 4, "threshold": 0.5},
    {"max_tokens": 24},  # the model's own block: 32 (prompt tail, one block)
]


@pytest.fixture(scope="module")
def sdar(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = testing.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", "sdar")
    return Engine(EngineConfig(model=str(path), device="cpu"))


@pytest.fixture(scope="module")
def llada2(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = testing.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llada2", "llada2")
    return Engine(EngineConfig(model=str(path), device="cpu"))


def _sdar_reference(engine: Engine, prompt: list[int], case: dict) -> list[int]:
    return testing.block_reference(engine, prompt, case)


_llada2_reference = _sdar_reference  # the dispatcher picks the family's loop


def _check(engine: Engine, cases: list[dict], reference) -> None:
    prompts = [engine.encode_prompt(text=t) for t in PROMPTS]
    check_alone_and_batched(engine, [(p, c) for c in cases for p in prompts], reference, past=4)


def test_sdar_engine_equals_reference_alone_and_batched(sdar: Engine) -> None:
    _check(sdar, SDAR_CASES, _sdar_reference)


def test_llada2_engine_equals_reference_alone_and_batched(llada2: Engine) -> None:
    _check(llada2, LLADA2_CASES, _llada2_reference)


def test_a_step_feeds_only_the_active_block_after_the_first(sdar: Engine) -> None:
    prompt = sdar.encode_prompt(text="What is 2+2? Tell me more.")
    case = {"max_tokens": 16, "block_length": 4, "steps": 4, "algorithm": "sequential"}
    tokens0 = sdar.runner.work["tokens"]
    out = sdar.generate([prompt], case)[0]
    fed = sdar.runner.work["tokens"] - tokens0
    # first step: prompt + first block; later steps: one block, twice a block at block starts
    blocks = -(-(len(prompt) + 16) // 4) - len(prompt) // 4
    first_end = (len(prompt) // 4 + 1) * 4
    assert out.steps > blocks  # sequential, 4 steps a block: several steps per block
    assert fed <= first_end + (out.steps - 1) * 4 + (blocks - 1) * 4
    assert fed < out.steps * (len(prompt) // 2), "the cache must make later steps short"


def test_abort_frees_the_pages(sdar: Engine) -> None:
    prompt = sdar.encode_prompt(text="abc")
    rid = sdar.add_request(None, prompt, {"max_tokens": 64, "block_length": 4})
    sdar.step()
    assert sdar.runner.block_pages.rows[rid].table
    sdar.abort(rid)
    outs = sdar.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert_pages_back(sdar)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"cache": "dual"}, "cache"),
        ({"block_length": 4, "steps": 5}, "steps"),
        ({"algorithm": "low_confidence"}, "algorithm"),
        ({"cfg_scale": 1.0}, "cfg_scale"),
        ({"algorithm": "sequential", "threshold": 0.5}, "threshold"),
        ({"multi_block": True}, "multi_block"),
        ({"algorithm": "sequential", "edit_threshold": 0.5}, "edit_threshold"),
        ({"algorithm": "joint_threshold", "max_nfe": 4}, "max_nfe"),
        # SDAR would leave the block masked after steps + 1 forwards
        ({"algorithm": "entropy_bounded", "block_length": 8, "steps": 6}, "steps"),
        ({"early_stop": True}, "early_stop"),
    ],
)
def test_block_diffusion_request_errors_name_the_field(
    sdar: Engine, params: dict, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        sdar.resolve_params(params)
    assert err.value.field == field


def test_seed_names_are_accepted(sdar: Engine) -> None:
    r = sdar.resolve_params(
        {"remasking_strategy": "entropy_bounded", "eb_threshold": 0.5, "block_size": 8}
    )
    assert (r.algorithm, r.threshold, r.block_length, r.steps) == ("entropy_bounded", 0.5, 8, 8)
    r = sdar.resolve_params({"algorithm": "entropy_bounded", "block_length": 8, "steps": 7})
    assert r.steps == 7  # steps + 1 forwards of one commit each fill the block
    r = sdar.resolve_params({"confidence_threshold": 0.7, "denoising_steps": 2})
    assert (r.algorithm, r.threshold, r.steps, r.block_length) == (
        "low_confidence_dynamic",
        0.7,
        2,
        sdar.model_block,
    )


def test_model_block_comes_from_the_checkpoint(
    sdar: Engine, llada2: Engine, tmp_path: Path
) -> None:
    assert sdar.model_block == int(sdar.loaded.config["block_size"])
    assert llada2.model_block == 32


def test_prefix_cache_reuses_prompt_blocks_without_changing_tokens(tmp_path: Path) -> None:
    path = testing.make_tiny_checkpoint(tmp_path / "sdar", "sdar")
    cached = Engine(EngineConfig(model=str(path), device="cpu"))
    plain = Engine(
        EngineConfig(model=str(path), device="cpu", prefix_cache_tokens=0), cached.loaded
    )
    system = "You are a careful assistant. Answer in one short line. " * 2
    prompts = [cached.encode_prompt(text=system + q) for q in ("2+2?", "Hi!", "Name a color.")]
    params = {"max_tokens": 12, "block_length": 4, "steps": 2}
    first = cached.generate(prompts[:1], params)  # indexes its prompt pages
    rest = cached.generate(prompts[1:], params)  # share the common ones
    expected = plain.generate(prompts, params)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in expected]
    pc = cached.runner.prefix_cache
    page = cached.runner.block_pages.pool.page_tokens
    shared = len(system) // page * page  # its whole pages of the system prompt (1 char = 1 token)
    assert pc.hit_tokens >= 2 * shared
    assert 0 < pc.hit_rate < 1
    fed_cached = cached.runner.work["tokens"]
    assert fed_cached < plain.runner.work["tokens"] - 2 * shared + 16


def _engine(like: Engine, **config) -> Engine:
    """A fresh engine (own pool and prefix cache) over `like`'s loaded model."""
    return Engine(EngineConfig(model=like.config.model, device="cpu", **config), like.loaded)


def _finish(engine: Engine) -> dict[str, list[int]]:
    """Step until every request has finished; their final token ids by request id."""
    return {o.request_id: o.token_ids for o in engine.outputs() if o.finished}


def test_same_prompt_shares_the_physical_pages(sdar: Engine) -> None:
    """(a) A second request with the same long prompt maps the first's page ids (reference
    count 2, no copy) for its whole prompt pages and starts after them; tokens unchanged."""
    engine = _engine(sdar)
    bp = engine.runner.block_pages
    page = bp.pool.page_tokens
    prompt = engine.encode_prompt(text="The quick brown fox jumps over the lazy dog. " * 2)
    case = {"max_tokens": 12, "block_length": 4, "steps": 2}
    expected = _sdar_reference(engine, prompt, case)
    first = engine.add_request(None, prompt, case)
    engine.step()  # its prefill: its whole prompt pages are indexed
    second = engine.add_request(None, prompt, case)
    engine.step()  # admitted: shares them
    whole = len(prompt) // 4 * 4 // page  # pages made of whole prompt blocks
    assert whole >= 4
    a, b = bp.rows[first].table, bp.rows[second].table
    assert a[:whole] == b[:whole]
    assert all(bp.pool.refs[p] == 2 for p in a[:whole])
    assert not set(a[whole:]) & set(b[whole:]), "pages past the shared prefix are the row's own"
    assert engine.runner.prefix_cache.hit_tokens == whole * page
    assert _finish(engine) == {first: expected, second: expected}
    assert_pages_back(engine)
    assert set(a[:whole]) <= set(bp.pool.idle), "the prompt pages stay cached, idle"


@pytest.mark.parametrize("prefix_cache_tokens", [0, 16384])
def test_pages_go_back_when_requests_finish_or_are_cancelled(
    sdar: Engine, prefix_cache_tokens: int
) -> None:
    """(b) Finished and cancelled requests return every page: the pool is as it started (with
    the prefix cache off, every page is on the free list again)."""
    engine = _engine(sdar, prefix_cache_tokens=prefix_cache_tokens)
    pool = engine.runner.block_pages.pool
    start = pool.available
    assert start == pool.pages == len(pool.free)
    prompts = [engine.encode_prompt(text=t) for t in ("Say something long please. " * 2, "abc")]
    case = {"max_tokens": 40, "block_length": 4, "steps": 4}
    engine.add_request(None, prompts[0], case)
    cancelled = engine.add_request(None, prompts[1], case)
    for _ in range(3):
        engine.step()
    held = sum(1 for r in pool.refs if r)
    assert held >= 2 and pool.reserved > 0 and pool.available < start
    engine.abort(cancelled)
    engine.step()
    assert cancelled not in engine.runner.block_pages.rows
    assert sum(1 for r in pool.refs if r) < held
    _finish(engine)
    assert_pages_back(engine)
    assert pool.available == start
    if not prefix_cache_tokens:
        assert len(pool.free) == start


def test_requests_wait_for_pages_and_finish_exact(sdar: Engine) -> None:
    """(c) More requests than the pool holds: the extra ones wait in the queue (never fail
    the others) and every one ends with the reference's tokens."""
    engine = _engine(sdar, kv_cache_tokens=80)  # 5 pages of 16; each request needs 2
    pool = engine.runner.block_pages.pool
    assert pool.pages == 5
    case = {"max_tokens": 16, "block_length": 4, "steps": 2}
    prompts = [engine.encode_prompt(text=t) for t in ("abc", "Hi", "x", "What?", "ok")]
    expected = [_sdar_reference(engine, p, case) for p in prompts]
    rids = [engine.add_request(None, p, case) for p in prompts]
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 3
    finals = {}
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        most = max(most, engine.num_running)
    assert most == 2
    assert [finals[r].finish_reason for r in rids] != ["error"] * 5
    assert [finals[r].token_ids for r in rids] == expected
    assert_pages_back(engine)
    too_long = engine.encode_prompt(text="y" * 70)
    with pytest.raises(InvalidRequestError, match="KV pages") as err:
        engine.add_request(None, too_long, case)
    assert err.value.field == "max_tokens"


def test_cached_pages_give_way_to_running_requests(sdar: Engine) -> None:
    """Idle cached prompt pages are evicted when requests need the pages: the requests run
    (exact), and the evicted prompt is no longer found."""
    engine = _engine(sdar, kv_cache_tokens=96)  # 6 pages of 16
    pool = engine.runner.block_pages.pool
    case = {"max_tokens": 16, "block_length": 4, "steps": 2}
    long = engine.encode_prompt(text="Forty-eight characters of a prompt to be cached.")
    assert len(long) == 48
    rid = engine.add_request(None, long, case)
    assert _finish(engine) == {rid: _sdar_reference(engine, long, case)}
    assert len(pool.idle) == 3
    prompts = [engine.encode_prompt(text=t) for t in ("abc", "Hi", "x")]  # 2 pages each
    rids = [engine.add_request(None, p, case) for p in prompts]
    engine.step()
    assert engine.num_running == 3 and pool.available == 0  # the idle pages are promised
    finals = _finish(engine)
    assert not pool.idle and len(pool.free) == 6, "taken as the rows grew, then freed"
    assert [finals[r] for r in rids] == [_sdar_reference(engine, p, case) for p in prompts]
    hits = engine.runner.prefix_cache.hit_tokens
    engine.generate([long], case)
    assert engine.runner.prefix_cache.hit_tokens == hits


def test_partial_prefix_shares_exactly_its_whole_pages(sdar: Engine) -> None:
    """(d) A prompt that shares only its first pages with a cached one reuses exactly those:
    the page cut by the first differing token (and everything after) is its own."""
    engine = _engine(sdar)
    bp = engine.runner.block_pages
    page = bp.pool.page_tokens
    common = "A shared system prompt of some length: "  # 2 whole pages, then 8 tokens
    case = {"max_tokens": 8, "block_length": 4, "steps": 2}
    a = engine.encode_prompt(text=common + " then question one, asked here.")
    b = engine.encode_prompt(text=common + " and a different second one here!")
    assert a[: 2 * page + 8] == b[: 2 * page + 8] and a[2 * page + 8] != b[2 * page + 8]
    first = engine.add_request(None, a, case)
    engine.step()
    table_a = list(bp.rows[first].table)
    assert _finish(engine) == {first: _sdar_reference(engine, a, case)}
    hits = engine.runner.prefix_cache.hit_tokens
    second = engine.add_request(None, b, case)
    engine.step()
    table_b = bp.rows[second].table
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert engine.runner.prefix_cache.hit_tokens - hits == 2 * page
    seq = next(s for s in engine.scheduler.running if s.request_id == second)
    assert seq.forwards == 1
    assert _finish(engine) == {second: _sdar_reference(engine, b, case)}
    assert_pages_back(engine)


def test_a_match_is_cut_to_whole_blocks_of_the_request(sdar: Engine) -> None:
    """With a block longer than a page a shared run ends on a block boundary: a prompt that
    agrees with a cached one for 3 pages of 16 inside blocks of 32 shares only 2."""
    engine = _engine(sdar)
    bp = engine.runner.block_pages
    assert bp.pool.page_tokens == 16
    case = {"max_tokens": 32, "block_length": 32, "steps": 8}
    a = engine.encode_prompt(text="0123456789" * 4 + "abcdefghij" * 3)  # 70: 2 blocks of 32
    b = engine.encode_prompt(text="0123456789" * 4 + "abcdefgh" + "Z" * 22)  # differs at 48
    assert a[:48] == b[:48] and a[48] != b[48]
    rid = engine.add_request(None, a, case)
    assert _finish(engine) == {rid: _sdar_reference(engine, a, case)}
    hits = engine.runner.prefix_cache.hit_tokens
    rid = engine.add_request(None, b, case)
    engine.step()
    assert engine.runner.prefix_cache.hit_tokens - hits == 32
    assert _finish(engine) == {rid: _sdar_reference(engine, b, case)}


def test_bucketed_shapes_give_the_same_tokens(sdar: Engine) -> None:
    """The CUDA-graph path's shapes (rows, query width and pages per row padded to buckets,
    padded rows and positions on the trash page) on CPU: tokens equal the reference."""
    engine = _engine(sdar)
    graphs = testing.EagerGraphs()
    engine.runner.graphs, engine.runner.length_multiple = graphs, 32
    prompts = [engine.encode_prompt(text=t) for t in PROMPTS[:3]]
    case = {"max_tokens": 13, "block_length": 4, "steps": 4}
    expected = [_sdar_reference(engine, p, case) for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, case)] == expected
    page = engine.runner.block_pages.pool.page_tokens
    pages = {s["block_pages"] for s in graphs.shapes}
    assert 4 in {s["block_q_index"][0] for s in graphs.shapes}  # 3 rows: bucket 4 (1 padded)
    assert all(p[1] * page % 64 == 0 for p in pages)  # keys: multiples of 64
    assert_pages_back(engine)


JOINT_CASES = [
    {"max_tokens": 12, "block_length": 4, "algorithm": "joint_threshold"},  # SGLang defaults
    {"max_tokens": 16, "block_length": 8, "algorithm": "joint_threshold", "threshold": 0.9,
     "edit_threshold": 0.3, "max_post_edit_steps": 2},
    {"max_tokens": 9, "block_length": 4, "algorithm": "joint_threshold", "threshold": 0.2,
     "edit_threshold": 0.05, "max_post_edit_steps": 0},
]  # fmt: skip


def _joint_reference(engine: Engine, prompt: list[int], case: dict) -> list[int]:
    run = testing.block_reference_run(engine, prompt, case)
    _joint_reference.edits += sum(sum(e) for e in run.edits)
    return testing.block_reference(engine, prompt, case)


_joint_reference.edits = 0


def test_llada21_token_editing_equals_reference(llada2: Engine) -> None:
    _check(llada2, JOINT_CASES, _joint_reference)
    assert _joint_reference.edits > 0, "the cases must exercise token edits"


def test_editing_streams_a_block_only_once_it_ended(llada2: Engine) -> None:
    """With token editing the active block may still be rewritten: text is released only
    at the step that ends a block (or the request), never from inside an open block."""
    prompt = llada2.encode_prompt(text="What is 2+2?")
    case = {"max_tokens": 16, "block_length": 4, "algorithm": "joint_threshold"}
    rid = llada2.add_request(None, prompt, case)
    llada2.step()  # admitted and first forward
    seq = next(s for s in llada2.scheduler.running if s.request_id == rid)
    released = 0
    while llada2.has_unfinished():
        block = seq.block
        outs = [o for o in llada2.step() if o.request_id == rid]
        if outs and outs[0].delta_text:
            released += 1
            assert seq.block != block or outs[0].finished, "text left an open block"
    assert released >= 1


def test_editing_keys_accept_their_contract_examples(llada2: Engine) -> None:
    from dlm_protocol import PARAMS

    for name in ("edit_threshold", "max_post_edit_steps"):
        param = next(p for p in PARAMS if p.name == name)
        r = llada2.resolve_params({"algorithm": "joint_threshold", name: param.examples[0]})
        assert getattr(r, name) == param.examples[0]
