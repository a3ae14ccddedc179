"""d3LLM's multi-block decoding with its delayed KV cache (`multi_block` with
`cache: prefix`).

At temperature 0 the engine equals the plain restatement of d3LLM's cached loop
(`reference.d3llm_multi_block_cached_generate`, which runs the model over an explicit KV cache
of its own, not the engine's pool) token for token, and takes the same kind of forward at every
step; batched with unlike rows every row equals its run alone; pool slots all come back.
"""

from __future__ import annotations

import pytest
import torch

from dlm_engine import Engine, InvalidRequestError, RequestOutput
from dlm_engine.models.common import full_logits
from dlm_engine.sequence import Sequence
from dlm_lab.reference import cached_forward, d3llm_multi_block_cached_generate
from dlm_lab.testing import SAMPLE_PROMPTS as PROMPTS
from dlm_lab.testing import chat_prompt, until_stop


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_suffix_forward_over_cache_equals_full_forward(engines, family) -> None:
    """The restatement's explicit-KV forward: a suffix over the keys of a full forward gives
    that forward's logits (tokens unchanged), and the same keys for the suffix."""
    model = engines[family].loaded.model
    x = torch.tensor([chat_prompt(engines[family], PROMPTS[0]) + [5, 6, 7, 8] * 4])
    with torch.no_grad():
        ref = full_logits(model)(x)
        logits, kv = cached_forward(model, x)
        torch.testing.assert_close(logits, ref)
        for c in (1, x.shape[1] // 2, x.shape[1] - 3):
            past = [(k[:, :, :c], v[:, :, :c]) for k, v in kv]
            part, fresh = cached_forward(model, x[:, c:], c, past)
            torch.testing.assert_close(part, ref[:, c:], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(fresh[0][0], kv[0][0][:, :, c:], rtol=1e-4, atol=1e-4)


CASES = [  # thresholds that commit in parallel; delays 1, 2, 5; periodic refresh every 3
    dict(max_tokens=48, block_length=8, threshold=3.0, block_add_threshold=0.0,
         decoded_token_threshold=1.0, cache_delay_iter=1),
    dict(max_tokens=64, block_length=8, threshold=2.5, block_add_threshold=0.5,
         decoded_token_threshold=0.5, cache_delay_iter=2, refresh_interval=3),
    dict(max_tokens=48, block_length=8, threshold=2.0, cache_delay_iter=2),
    dict(max_tokens=32, block_length=4, threshold=2.5, block_add_threshold=0.3,
         decoded_token_threshold=0.5, cache_delay_iter=5),
    dict(max_tokens=32, block_length=4, threshold=4.0, block_add_threshold=0.5,
         decoded_token_threshold=0.5, cache_delay_iter=3, refresh_interval=4),
]  # fmt: skip


def _engine_run(eng: Engine, prompt: list[int], params: dict) -> tuple[RequestOutput, Sequence]:
    eng.add_request("solo", prompt, params)
    seq = eng.scheduler.waiting[-1]
    out = [o for o in eng.outputs() if o.finished][-1]
    return out, seq


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_engine_equals_d3llm_cached_loop(engines, family) -> None:
    eng = engines[family]
    lm, r = eng.loaded, eng.runner
    kinds: dict[str, int] = {}
    overlaps = parallel = 0
    for case in CASES:
        for text in PROMPTS[:3]:
            prompt = chat_prompt(eng, text)
            trace: list[str] = []
            x = d3llm_multi_block_cached_generate(
                lm.model,
                torch.tensor([prompt]),
                family=family,
                mask_id=lm.mask_id,
                gen_length=case["max_tokens"],
                block_size=case["block_length"],
                threshold=case["threshold"],
                block_add_threshold=case.get("block_add_threshold", 0.1),
                decoded_token_threshold=case.get("decoded_token_threshold", 0.95),
                cache_delay_iter=case["cache_delay_iter"],
                refresh_interval=case.get("refresh_interval"),
                trace=trace,
            )
            refreshes, spans = r.refreshes, r.span_steps
            params = dict(case, multi_block=True, cache="prefix", temperature=0.0)
            out, seq = _engine_run(eng, prompt, params)
            assert out.token_ids == until_stop(eng, x[0, len(prompt) :].tolist()), (case, text)
            cache = seq.multi.cache
            history = cache.history
            assert history == trace[: len(history)], (case, text)  # same forward, every step
            assert len(history) == out.steps
            # whole-sequence forwards: no cache yet (the first caching step too), refreshes
            whole = sum(k in ("full", "refresh", "periodic") for k in history)
            whole += "cache" in history
            assert (r.refreshes - refreshes, r.span_steps - spans) == (whole, len(history) - whole)
            for k in history:
                kinds[k] = kinds.get(k, 0) + 1
            overlaps += cache.upstream_overlaps
            parallel += out.finish_reason == "length" and out.steps < case["max_tokens"]
            assert not r.slots and len(r.pool.free) == r.pool.rows
    # the cases exercise every kind of step, and commit in parallel
    assert all(kinds.get(k, 0) > 0 for k in ("full", "cache", "span", "refresh", "periodic"))
    assert parallel >= 3
    if family == "dream":  # two blocks stabilized together: upstream's duplicated keys path
        assert overlaps > 0
    else:  # LLaDA's walk stops at a stabilizing block: refresh_pos is always the cache's end
        assert overlaps == 0


def _key(o: RequestOutput) -> tuple:
    return (o.token_ids, o.text, o.finish_reason, o.steps, o.completion_tokens)


MIXED = [
    dict(max_tokens=48, block_length=8, multi_block=True, cache="prefix", threshold=3.0,
         block_add_threshold=0.0, decoded_token_threshold=1.0, cache_delay_iter=1),
    dict(max_tokens=32, steps=16, block_length=8, cache="dual"),
    dict(max_tokens=32, block_length=8, multi_block=True, threshold=2.5),
    dict(max_tokens=32, block_length=4, cache_delay_iter=3, refresh_interval=4, threshold=4.0,
         block_add_threshold=0.5, decoded_token_threshold=0.5),  # implies multi_block, prefix
    dict(max_tokens=24, steps=24),
    dict(max_tokens=64, block_length=8, multi_block=True, cache="prefix", threshold=2.5,
         block_add_threshold=0.5, decoded_token_threshold=0.5, refresh_interval=3),
]  # fmt: skip


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_batched_equals_alone_and_slots_come_back(engines, family) -> None:
    eng = engines[family]
    r = eng.runner
    prompts = [chat_prompt(eng, PROMPTS[i % 4] + " " * (i // 4)) for i in range(len(MIXED))]
    alone = [_key(eng.generate([p], c)[0]) for p, c in zip(prompts, MIXED, strict=True)]
    final: dict[str, RequestOutput] = {}
    half = len(MIXED) // 2
    for i in range(half):
        eng.add_request(f"m{i}", prompts[i], MIXED[i])
    for _ in range(3):  # the rest join mid-flight, in other phases
        final.update({o.request_id: o for o in eng.step() if o.finished})
    for i in range(half, len(MIXED)):
        eng.add_request(f"m{i}", prompts[i], MIXED[i])
    final.update({o.request_id: o for o in eng.outputs() if o.finished})
    assert [_key(final[f"m{i}"]) for i in range(len(MIXED))] == alone
    assert not r.slots and len(r.pool.free) == r.pool.rows


def test_abort_mid_generation_frees_the_slot(engines) -> None:
    eng = engines["llada"]
    r = eng.runner
    params = dict(MIXED[0], max_tokens=64)
    eng.add_request("a", chat_prompt(eng, PROMPTS[1]), params)
    seq = eng.scheduler.waiting[-1]
    assert not eng.scheduler._hold(seq)  # no block start to wait for
    for _ in range(4):
        eng.step()
    assert "a" in r.slots and "span" in seq.multi.cache.history
    eng.abort("a")
    while eng.has_unfinished():
        eng.step()
    assert not r.slots and len(r.pool.free) == r.pool.rows


def test_keys_resolve(engines) -> None:
    eng = engines["llada"]
    mb = eng.resolve_params(dict(multi_block=True, cache="prefix"))
    assert (mb.cache, mb.accel.cache_delay_iter, mb.accel.refresh_interval) == ("prefix", 2, None)
    implied = eng.resolve_params(dict(cache_delay_iter=32, refresh_interval=5))
    assert implied.accel.multi_block and implied.cache == "prefix"
    assert (implied.accel.cache_delay_iter, implied.accel.refresh_interval) == (32, 5)
    assert eng.resolve_params(dict(multi_block=True)).cache == "none"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(multi_block=True, cache="dual"), "cache"),
        (dict(cache_delay_iter=2, cache="dual"), "cache"),
        (dict(cache_delay_iter=0), "cache_delay_iter"),
        (dict(refresh_interval=0, multi_block=True, cache="prefix"), "refresh_interval"),
        (dict(cache_delay_iter=2.5), "cache_delay_iter"),
        (dict(cache_delay_iter=2, cache="none"), "cache_delay_iter"),
        (dict(multi_block=True, refresh_interval=3, cache="none"), "refresh_interval"),
        (dict(cache_delay_iter=2, multi_block=False), "cache_delay_iter"),
        (dict(refresh_interval=3, algorithm="low_confidence", cache="prefix"), "algorithm"),
    ],
)
def test_bad_values_name_the_field(engines, params, field) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["dream"].resolve_params(params)
    assert err.value.field == field
