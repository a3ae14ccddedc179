"""LocalLeap, d3LLM entropy threshold and multi-block, Fast-dLLM factor.

At temperature 0 each equals its plainly restated upstream loop (`dlm_lab.reference`)
token for token at batch 1; batched with unlike rows (other algorithms, multi-block beside
single-block and cached rows) every row equals its run alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm_engine import Engine, EngineConfig, InvalidRequestError, RequestOutput
from dlm_engine.decoding.checkpoint_defaults import write_d3llm_card
from dlm_engine.models.common import full_logits
from dlm_lab.reference import (
    d3llm_entropy_generate,
    d3llm_multi_block_generate,
    fast_dllm_factor_generate,
    local_leap_generate,
)
from dlm_lab.testing import SAMPLE_PROMPTS as PROMPTS
from dlm_lab.testing import chat_prompt, make_tiny_checkpoint, until_stop


def _ref(engine: Engine, fn, prompt: list[int], **kw) -> list[int]:
    lm = engine.loaded
    x = fn(full_logits(lm.model), torch.tensor([prompt]), mask_id=lm.mask_id, **kw)
    return until_stop(engine, x[0, len(prompt) :].tolist())


def _check(engine: Engine, params: dict, fn, **ref_kw) -> float:
    """Engine == reference on three prompts; returns the mean tokens per forward."""
    tpf = []
    for text in PROMPTS[:3]:
        prompt = chat_prompt(engine, text)
        out = engine.generate([prompt], dict(params, temperature=0.0))[0]
        assert out.token_ids == _ref(engine, fn, prompt, **ref_kw), (params, text)
        if out.finish_reason == "length":
            tpf.append(params["max_tokens"] / out.steps)
    return sum(tpf) / max(1, len(tpf))


@pytest.mark.parametrize(("max_tokens", "block", "factor"), [(32, 8, 1.0), (24, 8, 3.0)])
def test_factor_equals_fast_dllm(engines, max_tokens, block, factor) -> None:
    eng = engines["llada"]
    params = dict(max_tokens=max_tokens, block_length=block, algorithm="factor", factor=factor)
    _check(eng, params, fast_dllm_factor_generate, gen_length=max_tokens, block_length=block,
           factor=factor)  # fmt: skip


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize(("block", "tau"), [(8, 0.5), (16, 2.5), (32, 3.5)])
def test_entropy_threshold_equals_d3llm(engines, family, block, tau) -> None:
    eng = engines[family]
    params = dict(max_tokens=32, block_length=block, algorithm="entropy_threshold", threshold=tau)
    _check(eng, params, d3llm_entropy_generate, family=family, gen_length=32,
           block_length=block, threshold=tau)  # fmt: skip


LEAP_CASES = [  # dlmserve's defaults (0.9 / 0.75 / 4) rarely fire on random weights
    dict(max_tokens=32, steps=32, block_length=8),
    dict(max_tokens=32, steps=16, block_length=16, anchor_threshold=0.3, neighbor_threshold=0.2),
    dict(
        max_tokens=24,
        steps=12,
        block_length=8,
        anchor_threshold=0.2,
        neighbor_threshold=0.1,
        leap_radius=2,
    ),  # fmt: skip
]


def test_local_leap_equals_dlmserve(engines) -> None:
    eng = engines["llada"]
    leaps = 0
    for case in LEAP_CASES:
        ref_kw = dict(
            steps=case["steps"],
            gen_length=case["max_tokens"],
            block_length=case["block_length"],
            anchor_threshold=case.get("anchor_threshold", 0.9),
            neighbor_threshold=case.get("neighbor_threshold", 0.75),
            radius=case.get("leap_radius", 4),
        )
        tpf = _check(eng, dict(case, use_local_leap=True), local_leap_generate, **ref_kw)
        leaps += tpf > case["max_tokens"] / case["steps"]
    assert leaps >= 1, "no case propagated beyond the schedule: the test would prove nothing"


MULTI_CASES = [
    dict(max_tokens=64, block_length=8, threshold=0.5),
    dict(
        max_tokens=64,
        block_length=16,
        threshold=2.5,
        block_add_threshold=0.5,
        decoded_token_threshold=0.5,
    ),  # fmt: skip
    dict(
        max_tokens=48,
        block_length=8,
        threshold=3.0,
        block_add_threshold=0.0,
        decoded_token_threshold=1.0,
    ),  # fmt: skip
]


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_multi_block_equals_d3llm(engines, family) -> None:
    eng = engines[family]
    parallel = 0
    for case in MULTI_CASES:
        ref_kw = dict(
            family=family,
            gen_length=case["max_tokens"],
            block_size=case["block_length"],
            threshold=case["threshold"],
            block_add_threshold=case.get("block_add_threshold", 0.1),
            decoded_token_threshold=case.get("decoded_token_threshold", 0.95),
        )
        params = dict(case, multi_block=True)
        parallel += _check(eng, params, d3llm_multi_block_generate, **ref_kw) > 1.0
    assert parallel >= 1


def _key(o: RequestOutput) -> tuple:
    return (o.token_ids, o.text, o.finish_reason, o.steps, o.completion_tokens)


MIXED = {
    "llada": [
        dict(max_tokens=32, steps=32, block_length=8),
        dict(max_tokens=32, block_length=8, multi_block=True, threshold=2.5),
        dict(max_tokens=24, block_length=8, algorithm="factor", factor=2.0),
        dict(
            max_tokens=24,
            steps=12,
            block_length=8,
            use_local_leap=True,
            anchor_threshold=0.2,
            neighbor_threshold=0.1,
        ),  # fmt: skip
        dict(max_tokens=32, block_length=16, algorithm="entropy_threshold", threshold=2.0),
        dict(max_tokens=32, steps=16, block_length=8, cache="dual"),
        dict(max_tokens=32, block_length=8, algorithm="factor", cache="prefix"),
        dict(
            max_tokens=32,
            block_length=8,
            multi_block=True,
            algorithm="factor",
            block_add_threshold=0.3,
            max_active_blocks=2,
        ),  # fmt: skip
        dict(max_tokens=32, algorithm="threshold", threshold=0.3, multi_block=True, block_length=8),
        dict(max_tokens=16, steps=8, block_length=4, cfg_scale=1.0),
    ],
    "dream": [
        dict(max_tokens=32, steps=32),
        dict(max_tokens=32, block_length=8, multi_block=True, threshold=2.0),
        dict(max_tokens=32, block_length=8, algorithm="entropy_threshold", threshold=2.5),
        dict(max_tokens=32, steps=16, block_length=8, cache="prefix"),
        dict(max_tokens=32, threshold=0.3),
        dict(
            max_tokens=24,
            block_length=8,
            multi_block=True,
            threshold=1.0,
            decoded_token_threshold=0.5,
        ),  # fmt: skip
    ],
}


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mixed_batch_equals_alone(engines, family) -> None:
    eng = engines[family]
    cases = MIXED[family]
    prompts = [chat_prompt(eng, PROMPTS[i % 4] + " " * (i // 4)) for i in range(len(cases))]
    alone = [_key(eng.generate([p], c)[0]) for p, c in zip(prompts, cases, strict=True)]
    final: dict[str, RequestOutput] = {}
    half = len(cases) // 2
    for i in range(half):
        eng.add_request(f"m{i}", prompts[i], cases[i])
    for _ in range(3):  # the rest join mid-flight
        final.update({o.request_id: o for o in eng.step() if o.finished})
    for i in range(half, len(cases)):
        eng.add_request(f"m{i}", prompts[i], cases[i])
    final.update({o.request_id: o for o in eng.outputs() if o.finished})
    assert [_key(final[f"m{i}"]) for i in range(len(cases))] == alone


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(algorithm="factor", factor=0), "factor"),
        (dict(algorithm="factor", threshold=0.5), "threshold"),
        (dict(factor=1.0, algorithm="low_confidence"), "factor"),
        (dict(use_local_leap=True, anchor_threshold=1.5), "anchor_threshold"),
        (dict(use_local_leap=True, leap_radius=0), "leap_radius"),
        (dict(use_local_leap=True, algorithm="random"), "use_local_leap"),
        (dict(anchor_threshold=0.5, algorithm="low_confidence"), "anchor_threshold"),
        (dict(algorithm="entropy_threshold", threshold=-1), "threshold"),
        (dict(multi_block=True, algorithm="low_confidence"), "algorithm"),
        (dict(multi_block=True, cache="dual"), "cache"),
        (dict(multi_block=True, decoded_token_threshold=0), "decoded_token_threshold"),
        (dict(multi_block=True, max_active_blocks=0), "max_active_blocks"),
        (dict(block_add_threshold=0.5, multi_block=False), "block_add_threshold"),
        (dict(multi_block="yes"), "multi_block"),
        (dict(local_leap_radius="x"), "leap_radius"),
    ],
)
def test_bad_values_name_the_field(engines, params, field) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["llada"].resolve_params(dict(params, max_tokens=32))
    assert err.value.field == field


def test_llada_only_rules_rejected_on_dream(engines) -> None:
    for params in (dict(use_local_leap=True), dict(algorithm="factor")):
        with pytest.raises(InvalidRequestError, match="LLaDA"):
            engines["dream"].resolve_params(params)


def test_seed_aliases(engines) -> None:
    eng = engines["llada"]
    r = eng.resolve_params(
        dict(
            use_local_leap=True,
            local_leap_anchor_threshold=0.8,
            local_leap_neighbor_threshold=0.6,
            local_leap_radius=3,
            force_single_batch=True,
            max_tokens=32,
        )  # fmt: skip
    )
    assert r.algorithm == "local_leap"
    assert (r.accel.anchor_threshold, r.accel.neighbor_threshold, r.accel.leap_radius) == (
        0.8,
        0.6,
        3,
    )
    assert eng.resolve_params(dict(use_local_leap=False)).algorithm == "low_confidence"
    mb = eng.resolve_params(dict(multi_block=True, max_tokens=64))
    assert (mb.algorithm, mb.threshold, mb.block_length) == ("entropy_threshold", 0.5, 32)
    assert (mb.accel.block_add_threshold, mb.accel.decoded_token_threshold) == (0.1, 0.95)


@pytest.fixture(scope="module")
def d3llm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Engine]:
    root = tmp_path_factory.mktemp("d3llm")
    out = {}
    for family, name in (("llada", "d3LLM_LLaDA"), ("dream", "d3LLM_Dream")):
        path: Path = make_tiny_checkpoint(root / name, family, seed=2)
        write_d3llm_card(path, family)
        out[family] = Engine(EngineConfig(model=str(path), max_rows=4))
    return out


@pytest.mark.parametrize(("family", "tau"), [("llada", 0.5), ("dream", 0.4)])
def test_d3llm_checkpoint_defaults_to_its_published_decoding(d3llm, family, tau) -> None:
    eng = d3llm[family]
    r = eng.resolve_params(dict(max_tokens=64))
    assert (r.algorithm, r.threshold, r.accel.multi_block) == ("entropy_threshold", tau, True)
    assert (r.block_length, r.accel.block_add_threshold) == (32, 0.1)
    # a request's own rule wins over the checkpoint's
    assert eng.resolve_params(dict(algorithm="low_confidence")).accel.multi_block is False
    prompt = chat_prompt(eng, PROMPTS[0])
    out = eng.generate([prompt], dict(max_tokens=32, block_length=8))[0]
    ref = _ref(eng, d3llm_multi_block_generate, prompt, family=family, gen_length=32,
               block_size=8, threshold=tau, block_add_threshold=0.1,
               decoded_token_threshold=0.95, eos_id=eng.loaded.eos_id)  # fmt: skip
    assert out.token_ids == ref
