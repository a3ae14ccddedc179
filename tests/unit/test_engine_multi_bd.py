"""Diffulex's multi-block diffusion (`algorithm: multi_bd`) in the engine equals the plain
no-cache restatement `reference_block.multi_bd_generate` token for token at temperature 0:
SDAR and LLaDA2, several prompts and parameter sets, each request alone and all in one batch
with unlike rows (single-block rows of other rules, multi_bd rows of other buffer sizes).

The engine feeds a multi_bd row's running set (several consecutive blocks, block-causal key
limits per query) in the ragged block group beside single-block rows, one forward per step,
over an exact KV cache of finished blocks; the reference forwards the whole canvas up to the
running set's end every step. Equal tokens mean the cache and the running set agree; the
window logits are also compared with a full forward at every step of one request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from block_checks import assert_pages_back, check_alone_and_batched

from dlm_engine import SamplingParams
from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_engine.errors import InvalidRequestError
from dlm_lab import testing
from dlm_lab.reference_block import (
    block_logits,
)
from dlm_lab.training import tasks

PROMPTS = ["Hello there", "abc", "What is 2+2? Tell me more.", "x"]
MBD = {"algorithm": "multi_bd"}
SDAR_CASES = [
    {**MBD, "max_tokens": 16, "block_length": 4},  # Diffulex's defaults (SDAR threshold 0.95)
    {**MBD, "max_tokens": 13, "block_length": 4, "threshold": 0.3, "buffer_size": 2},
    # Diffulex's own names; every block may enter at once, a lower bar for forcing commits
    {"decoding_strategy": "multi_bd", "max_tokens": 20, "block_size": 4, "accept_threshold": 0.2,
     "add_block_threshold": 0.0, "semi_complete_threshold": 0.5},
    {**MBD, "max_tokens": 12, "block_length": 8, "threshold": 0.1, "buffer_size": 1},
    {**MBD, "max_tokens": 24, "block_length": 4, "threshold": 1.0, "add_block_threshold": 0.0,
     "buffer_size": 3},  # only forced commits: blocks wait on their predecessors
]  # fmt: skip
LLADA2_CASES = [
    {**MBD, "max_tokens": 16, "block_length": 4},  # threshold 0.9 (accept_threshold)
    {**MBD, "max_tokens": 20, "block_length": 4, "threshold": 0.2, "add_block_threshold": 0.0,
     "buffer_size": 3, "semi_complete_threshold": 0.5},
    {**MBD, "max_tokens": 12, "block_length": 8, "threshold": 0.3, "buffer_size": 2},
]  # fmt: skip


@pytest.fixture(scope="module")
def sdar(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = testing.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", "sdar")
    return Engine(EngineConfig(model=str(path), device="cpu"))


@pytest.fixture(scope="module")
def llada2(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = testing.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llada2", "llada2")
    return Engine(EngineConfig(model=str(path), device="cpu"))


def _mbd_run(engine: Engine, prompt: list[int], case: dict):
    return testing.block_reference_run(engine, prompt, case)


def _reference(engine: Engine, prompt: list[int], case: dict) -> list[int]:
    """The plain loop of the case's rule: multi_bd's, or a single-block rule's."""
    if engine.resolve_params(case).algorithm == "multi_bd":
        run = _mbd_run(engine, prompt, case)
        _reference.widest = max(_reference.widest, *map(len, run.running))
    return testing.block_reference(engine, prompt, case)


_reference.widest = 0  # most blocks one reference forward sampled


def _check(engine: Engine, pairs: list[tuple[list[int], dict]]) -> None:
    check_alone_and_batched(engine, pairs, _reference, past=8)


def _pairs(engine: Engine, cases: list[dict], prompts: list[str] = PROMPTS) -> list:
    ids = [engine.encode_prompt(text=t) for t in prompts]
    return [(p, c) for c in cases for p in ids]


def test_sdar_multi_bd_equals_reference_alone_and_batched(sdar: Engine) -> None:
    _reference.widest = 0
    _check(sdar, _pairs(sdar, SDAR_CASES))
    assert _reference.widest >= 3, "the cases must refine several blocks in one forward"


def test_llada2_multi_bd_equals_reference_alone_and_batched(llada2: Engine) -> None:
    _reference.widest = 0
    _check(llada2, _pairs(llada2, LLADA2_CASES, PROMPTS[1:]))
    assert _reference.widest >= 3


def test_multi_bd_batched_with_unlike_rows(sdar: Engine) -> None:
    """One batch: multi_bd rows of buffer sizes 1, 2, 4 beside single-block rows of SDAR's
    rules and LLaDA2.1's token editing, different blocks and lengths."""
    cases = [
        {**MBD, "max_tokens": 16, "block_length": 4, "threshold": 0.2, "buffer_size": 4,
         "add_block_threshold": 0.0},
        {**MBD, "max_tokens": 14, "block_length": 4, "threshold": 0.2, "buffer_size": 2},
        {**MBD, "max_tokens": 12, "block_length": 8, "threshold": 0.3, "buffer_size": 1},
        {"max_tokens": 13, "block_length": 4, "steps": 4},  # low_confidence_dynamic
        {"max_tokens": 12, "block_length": 8, "steps": 4, "algorithm": "sequential"},
        {"max_tokens": 10, "block_length": 4, "algorithm": "entropy_bounded", "threshold": 2.0},
        {"max_tokens": 12, "block_length": 4, "algorithm": "joint_threshold",
         "edit_threshold": 0.3, "max_post_edit_steps": 2},
    ]  # fmt: skip
    prompts = [sdar.encode_prompt(text=t) for t in PROMPTS[1:]]
    pairs = [(prompts[i % len(prompts)], c) for i, c in enumerate(cases)]
    pairs += [(prompts[(i + 1) % len(prompts)], c) for i, c in enumerate(cases[:3])]
    _check(sdar, pairs)


def test_cache_is_exact_at_every_step(sdar: Engine) -> None:
    """Step one multi_bd request by hand: before each step, the engine's window logits (its
    cached keys of finished blocks plus the running set's fresh ones) equal a full
    block-causal forward of the current canvas; keys count as final only up to a block
    that held no mask when it was last fed."""
    prompt = sdar.encode_prompt(text="What is 2+2? Tell me more.")
    case = {**MBD, "max_tokens": 24, "block_length": 4, "threshold": 0.5, "buffer_size": 3,
            "add_block_threshold": 0.0}  # fmt: skip
    rid = sdar.add_request(None, prompt, case)
    sdar.scheduler.admit()
    seq = next(s for s in sdar.scheduler.running if s.request_id == rid)
    widths, fed = [], []
    while not seq.finished:
        if seq.forwards:  # the first step is the prefill: nothing cached yet
            logits, _ = sdar.runner._window_logits([seq])
            full = block_logits(sdar.loaded.model, seq.tokens, seq.window_start, seq.block_end, 4)
            w = seq.window_width
            torch.testing.assert_close(logits[0, :w], full, rtol=1e-4, atol=1e-4)
        widths.append(seq.window_width)
        fed.append(seq.step_tokens)
        upto = seq.kv_upto
        sdar.step()
        assert seq.kv_upto >= upto and seq.kv_upto % 4 == 0
        assert (
            seq.kv_upto <= seq.prompt_len
            or sdar.mask_id not in seq.canvas[: seq.kv_upto - seq.prompt_len]
        )
    assert len(widths) > 8 and max(widths) > 4, "several blocks ran at once, for long"
    assert max(widths) <= 3 * 4
    # after the prefill a step feeds its running set and completed blocks once more
    assert max(fed[1:]) <= 4 * 4 + 4
    assert_pages_back(sdar)


def test_running_set_respects_buffer_and_entry_rules(sdar: Engine) -> None:
    prompt = sdar.encode_prompt(text="What is 2+2?")
    base = {**MBD, "max_tokens": 32, "block_length": 4, "threshold": 1.0}
    for size in (1, 2, 4):
        run = _mbd_run(sdar, prompt, {**base, "buffer_size": size, "add_block_threshold": 0.0})
        assert max(map(len, run.running)) == size
        assert all(b == sorted(b) and b == list(range(b[0], b[-1] + 1)) for b in run.running)
    # a bar no block reaches before it is complete: one block at a time, each waiting for
    # its predecessor to be stored (the front block keeps its slot for that step)
    run = _mbd_run(sdar, prompt, {**base, "buffer_size": 4, "add_block_threshold": 1.0})
    assert max(map(len, run.running)) == 1
    # nothing passes threshold 1.0: one forced commit a forward, so every token costs one
    free = _mbd_run(sdar, prompt, {**base, "add_block_threshold": 0.0})
    assert all(c in (0, 1) for counts in free.commits for c in counts)


def test_max_nfe_commits_the_running_set_and_ends(sdar: Engine) -> None:
    prompt = sdar.encode_prompt(text="abc")
    case = {**MBD, "max_tokens": 24, "block_length": 4, "threshold": 1.0,
            "add_block_threshold": 0.0, "max_nfe": 3}  # fmt: skip
    out = sdar.generate([prompt], case)[0]
    assert out.steps == 3 and out.finish_reason in ("length", "stop")
    assert_pages_back(sdar)


# ---- request keys ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llada(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = testing.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llada", "llada")
    return Engine(EngineConfig(model=str(path), device="cpu"))


def test_defaults_and_diffulex_names(sdar: Engine, llada2: Engine) -> None:
    r = sdar.resolve_params(MBD)
    assert (r.algorithm, r.threshold, r.buffer_size) == ("multi_bd", 0.95, 4)
    assert (r.add_block_threshold, r.semi_complete_threshold) == (0.1, 0.9)
    assert r.block_length == sdar.model_block
    assert llada2.resolve_params(MBD).threshold == 0.9  # Diffulex's accept_threshold
    r = sdar.resolve_params(
        {"decoding_strategy": "multi_bd", "block_size": 8, "buffer_size": 2,
         "accept_threshold": 0.8, "add_block_threshold": 0.25, "semi_complete_threshold": 0.5}
    )  # fmt: skip
    assert (r.algorithm, r.block_length, r.buffer_size, r.threshold) == ("multi_bd", 8, 2, 0.8)
    assert (r.add_block_threshold, r.semi_complete_threshold) == (0.25, 0.5)


def test_multi_bd_keys_accept_their_contract_examples(sdar: Engine) -> None:
    from dlm_protocol import PARAMS

    for name in ("buffer_size", "add_block_threshold", "semi_complete_threshold"):
        param = next(p for p in PARAMS if p.name == name)
        assert (
            getattr(sdar.resolve_params({**MBD, name: param.examples[0]}), name)
            == (param.examples[0])
        )


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({**MBD, "steps": 2}, "steps"),
        ({**MBD, "threshold": 1.5}, "threshold"),
        ({**MBD, "buffer_size": 0}, "buffer_size"),
        ({**MBD, "buffer_size": 2.0}, "buffer_size"),
        ({**MBD, "add_block_threshold": -0.1}, "add_block_threshold"),
        ({**MBD, "semi_complete_threshold": 1.5}, "semi_complete_threshold"),
        ({**MBD, "edit_threshold": 0.5}, "edit_threshold"),
        ({**MBD, "cache": "dual"}, "cache"),
        ({**MBD, "multi_block": True}, "multi_block"),
        ({"buffer_size": 2}, "buffer_size"),  # the default rule is single-block
        ({"algorithm": "sequential", "add_block_threshold": 0.2}, "add_block_threshold"),
        ({"algorithm": "joint_threshold", "semi_complete_threshold": 0.5}, "semi_complete_threshold"),
        ({"decoding_strategy": "d2f"}, "algorithm"),
    ],
)  # fmt: skip
def test_multi_bd_errors_name_the_field(sdar: Engine, params: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        sdar.resolve_params(params)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (MBD, "algorithm"),
        ({"decoding_strategy": "multi_bd"}, "algorithm"),
        ({"buffer_size": 2}, "buffer_size"),
        ({"add_block_threshold": 0.1}, "add_block_threshold"),
        ({"semi_complete_threshold": 0.9}, "semi_complete_threshold"),
        # the other block-diffusion rules are proven against SDAR/LLaDA2 loops only
        ({"algorithm": "sequential"}, "algorithm"),
        ({"algorithm": "entropy_bounded", "threshold": 0.5}, "algorithm"),
        ({"algorithm": "joint_threshold"}, "algorithm"),
        ({"algorithm": "low_confidence_static"}, "algorithm"),
        ({"algorithm": "low_confidence_dynamic"}, "algorithm"),
    ],
)
def test_llada_refuses_multi_bd_by_name(llada: Engine, params: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llada.resolve_params(params)
    assert err.value.field == field
    assert "block-diffusion" in str(err.value)


# ---- the embedded trained model -------------------------------------------------------------

ASSET = Path(__file__).resolve().parents[2] / "dlm_engine" / "assets" / "tiny-sdar"
N_QUESTIONS = 60
MIN_ACCURACY = 0.85  # measured 98.3% (the default single-block rule: 100%)


def _answer_all(engine: Engine, params: dict) -> tuple[float, float]:
    """(exact-match accuracy, completion tokens per forward) on the held-out questions."""
    examples = tasks.heldout_examples(N_QUESTIONS)
    sampling = SamplingParams(max_tokens=32, temperature=0.0, **params)
    for i, ex in enumerate(examples):
        engine.add_request(f"q{i}", engine.encode_prompt(messages=tasks.messages_for(ex)), sampling)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    outs = [finals[f"q{i}"] for i in range(len(examples))]
    assert all(o.finish_reason == "stop" for o in outs), "every answer stops by itself"
    right = sum(o.text.strip() == ex.answer for o, ex in zip(outs, examples, strict=True))
    return right / len(examples), sum(o.completion_tokens for o in outs) / sum(
        o.steps for o in outs
    )


def test_tiny_sdar_answers_heldout_questions_with_multi_bd() -> None:
    """The trained SDAR-layout model (blocks of 4) with multi_bd at Diffulex's defaults:
    accuracy and tokens per forward against the family's default single-block rule
    (reported with -s; no speed is asserted), and the engine equal to the reference on
    a few questions, where the confident model fills whole blocks per forward."""
    engine = Engine(EngineConfig(model=str(ASSET), device="cpu", max_rows=N_QUESTIONS))
    default_acc, default_tpf = _answer_all(engine, {})
    acc, tpf = _answer_all(engine, MBD)
    print(
        f"\ntiny-sdar held-out ({N_QUESTIONS}): low_confidence_dynamic {default_acc:.1%} at "
        f"{default_tpf:.2f} tokens/forward; multi_bd {acc:.1%} at {tpf:.2f} tokens/forward"
    )
    assert acc >= MIN_ACCURACY
    case = {**MBD, "max_tokens": 32}
    for ex in tasks.heldout_examples(4):
        prompt = engine.encode_prompt(messages=tasks.messages_for(ex))
        expected = testing.block_reference(engine, prompt, case)
        assert engine.generate([prompt], case)[0].token_ids == expected
