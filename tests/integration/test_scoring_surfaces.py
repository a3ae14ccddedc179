"""Scoring a prompt: completions `echo: true` + `max_tokens: 0` through the real proxy
with the official `openai` client (plain and streamed), and the contract's `score` key over
Triton gRPC and HTTP: the same seeded estimate everywhere, per-token values summing to it."""

from __future__ import annotations

import math

import openai
import proxy_fixtures
import pytest
from dlm_client import DLMClient

pytestmark = pytest.mark.integration

proxy = proxy_fixtures.proxy
oai = proxy_fixtures.oai
model = proxy_fixtures.model

TEXT = "The cat sat."


def test_echo_scores_the_prompt(oai: openai.OpenAI, model: str, client: DLMClient) -> None:
    keys = {"mc_samples": 32, "seed": 7}
    r = oai.completions.create(
        model=model, prompt=TEXT, echo=True, max_tokens=0, logprobs=0, extra_body=keys
    )
    choice = r.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert "".join(lp.tokens) == TEXT and lp.text_offset[0] == 0
    assert all(v < 0 for v in lp.token_logprobs)
    assert all(v > 0 for v in lp.model_extra["variances"])
    total = choice.model_extra["log_likelihood"]
    assert sum(lp.token_logprobs) == pytest.approx(total, abs=1e-4)
    assert choice.model_extra["mc_samples"] == 32
    assert choice.model_extra["log_likelihood_variance"] > 0
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(lp.tokens)
    assert r.usage.forwards == 4  # 32 samples, 8 per forward

    stream = oai.completions.create(
        model=model, prompt=TEXT, echo=True, max_tokens=0, stream=True, extra_body=keys
    )
    chunks = [c for ch in stream for c in ch.choices if c.logprobs is not None]
    assert len(chunks) == 1 and chunks[0].text == TEXT
    assert chunks[0].model_extra["log_likelihood"] == pytest.approx(total)

    for out in (
        client.generate(TEXT, score=True, **keys),
        client.generate_http(TEXT, score=True, **keys),
    ):
        assert out.text == TEXT and out.score["mc_samples"] == 32
        assert out.score["log_likelihood"] == pytest.approx(total)
        assert [e["token"] for e in out.logprobs] == lp.tokens
        assert math.sqrt(out.score["variance"]) < abs(total)


def test_scoring_errors_name_the_field(oai: openai.OpenAI, model: str) -> None:
    for kw, field in (
        ({"echo": True, "max_tokens": 4}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "max_tokens": 0, "extra_body": {"mc_samples": 0}}, "mc_samples"),
        ({"echo": True, "max_tokens": 0, "extra_body": {"regex": "a+"}}, "score"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model=model, prompt=TEXT, **kw)
        assert err.value.body["param"] == field, (kw, err.value.body)
