"""Scoring a text under the masked-diffusion objective (`score` + `mc_samples`): the
Monte-Carlo estimate agrees with the exact bound, computed by enumerating every mask of a short
text, within its reported variance; per-token values sum to the total; seeded runs repeat;
generation rows beside a scoring request are unchanged."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dlm_engine import Engine, InvalidRequestError, RequestOutput
from dlm_engine.models.common import full_logits


def _score(eng: Engine, ids: list[int], **params) -> RequestOutput:
    rid = eng.add_request(None, ids, {"score": True, **params})
    return next(o for o in eng.outputs() if o.request_id == rid)


def _exact(eng: Engine, ids: list[int]) -> list[float]:
    """Per-token share of the bound E_k E_M [sum_{i in M} log p(x_i | rest) * L / k], by
    enumerating every non-empty mask M of the scorable positions (k = |M| uniform on 1..L)."""
    shift = eng.runner.shift
    positions = list(range(shift, len(ids)))
    n = len(positions)
    masks = [m for k in range(1, n + 1) for m in itertools.combinations(positions, k)]
    x = torch.tensor([[eng.mask_id if i in m else t for i, t in enumerate(ids)] for m in masks])
    with torch.inference_mode():
        logits = full_logits(eng.runner.model)(x).float()
    if shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    logp = torch.log_softmax(logits, -1)
    share = [0.0] * len(ids)
    for row, m in enumerate(masks):
        weight = 1 / n / math.comb(n, len(m)) * n / len(m)
        for i in m:
            share[i] += weight * logp[row, i, ids[i]].item()
    return share


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_estimate_matches_the_exact_bound(engines: dict[str, Engine], family: str) -> None:
    eng = engines[family]
    ids = eng.tokenizer.encode("abcdef", add_special_tokens=False)
    out = _score(eng, ids, mc_samples=512, seed=1)
    assert out.finished and out.finish_reason == "length" and out.completion_tokens == 0
    assert out.steps == 512 // 8  # forwards: batches of 8 samples
    assert out.text == "abcdef" and out.token_ids == ids
    exact = _exact(eng, ids)
    total = out.score["log_likelihood"]
    sd = math.sqrt(out.score["variance"])
    assert out.score["mc_samples"] == 512
    assert out.score["tokens"] == len(ids) - eng.runner.shift
    assert abs(total - sum(exact)) < 4 * sd + 1e-3, (total, sum(exact), sd)
    values = [e["logprob"] for e in out.logprobs]
    shift = eng.runner.shift
    assert values[:shift] == [None] * shift  # Dream: the first token is context only
    assert sum(values[shift:]) == pytest.approx(total, abs=1e-6)
    for e, want in zip(out.logprobs[shift:], exact[shift:], strict=True):
        assert e["logprob"] < 0 and e["variance"] > 0
        assert abs(e["logprob"] - want) < 5 * math.sqrt(e["variance"]) + 1e-3
    assert [e["token"] for e in out.logprobs] == list("abcdef")


def test_seeded_repeats_and_variance_falls(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    ids = eng.tokenizer.encode("Hello there", add_special_tokens=False)
    a, b = (_score(eng, ids, mc_samples=16, seed=3) for _ in range(2))
    assert a.score == b.score and a.logprobs == b.logprobs
    wide = _score(eng, ids, mc_samples=256, seed=3)
    assert wide.score["variance"] < a.score["variance"]
    one = _score(eng, ids, mc_samples=1, seed=3)
    assert one.score["variance"] is None and all(e["variance"] is None for e in one.logprobs)


def test_generation_beside_scoring_is_unchanged(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    prompt = eng.encode_prompt(messages=[{"role": "user", "content": "abc"}])
    gen = {"max_tokens": 16, "temperature": 0.8, "seed": 5}
    alone = eng.generate([prompt], gen)[0]
    ids = eng.tokenizer.encode("abcdef", add_special_tokens=False)
    scored_alone = _score(eng, ids, mc_samples=24, seed=2)
    eng.add_request("g", prompt, gen)
    eng.add_request("s", ids, {"score": True, "mc_samples": 24, "seed": 2})
    finals = {o.request_id: o for o in eng.outputs() if o.finished}
    assert finals["g"].token_ids == alone.token_ids
    assert finals["s"].score == scored_alone.score


def test_scoring_requests_are_checked(engines: dict[str, Engine]) -> None:
    eng = engines["dream"]
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request(None, eng.tokenizer.encode("a", add_special_tokens=False), {"score": True})
    assert err.value.field == "prompt"
    for params, field in (
        ({"score": True, "regex": "a"}, "score"),
        ({"score": True, "mc_samples": 0}, "mc_samples"),
        ({"score": True, "mc_samples": 1025}, "mc_samples"),
        ({"score": "yes"}, "score"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            eng.resolve_params(params)
        assert err.value.field == field
    assert eng.resolve_params({"mc_samples": 8}).score is None  # generation ignores it
    assert eng.resolve_params({"score": True}).score == 32
