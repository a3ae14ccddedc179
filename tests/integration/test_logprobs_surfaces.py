"""Logprobs through every surface: the real proxy with the official `openai` client
(chat `logprobs` + `top_logprobs`, completions `logprobs: N`, streamed and not, each token with
the diffusion `step` that committed it), and Triton gRPC and HTTP through `dlm_client`."""

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

MSG = [{"role": "user", "content": "Count: 1 2 3"}]
# greedy, the whole canvas (EOS suppressed), two blocks: deterministic on every surface
KEYS = {"max_tokens": 16, "steps": 16, "block_length": 8, "suppress_eos": True}


def _visible(token: str) -> str:
    """The tiny tokenizer's special tokens (`<|...|>`) are spelled in logprobs, not in text."""
    return "" if token.startswith("<|") and token.endswith("|>") else token


def _check_chat_tokens(content: list, text: str, top: int, forwards: int) -> None:
    assert content, "no logprobs"
    assert "".join(_visible(t.token) for t in content) == text
    for t in content:
        assert math.isfinite(t.logprob) and t.logprob <= 0
        assert bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == top
        if top:
            assert t.logprob <= t.top_logprobs[0].logprob + 1e-5
            values = [a.logprob for a in t.top_logprobs]
            assert values == sorted(values, reverse=True)
        assert 1 <= t.model_extra["step"] <= forwards


def test_chat_logprobs_plain_and_streamed(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(
        model=model, messages=MSG, logprobs=True, top_logprobs=3, extra_body=KEYS
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    _check_chat_tokens(content, choice.message.content, 3, r.usage.forwards)
    assert len(content) == r.usage.completion_tokens - (choice.finish_reason == "stop")
    # one token per step (steps = max_tokens): every step committed exactly one token
    assert sorted(t.model_extra["step"] for t in content) == list(range(1, len(content) + 1))

    stream = oai.chat.completions.create(
        model=model, messages=MSG, logprobs=True, top_logprobs=3, stream=True, extra_body=KEYS
    )
    pieces, text = [], ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                assert "".join(_visible(t.token) for t in c.logprobs.content) == (
                    c.delta.content or ""
                ), "a chunk's logprobs are the tokens of its delta"
                pieces += c.logprobs.content
    assert text == choice.message.content
    assert [(t.token, t.model_extra["step"]) for t in pieces] == [
        (t.token, t.model_extra["step"]) for t in content
    ]
    assert [t.logprob for t in pieces] == pytest.approx([t.logprob for t in content], abs=1e-5)

    plain = oai.chat.completions.create(model=model, messages=MSG, extra_body=KEYS)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content


def test_completions_logprobs_plain_and_streamed(oai: openai.OpenAI, model: str) -> None:
    r = oai.completions.create(model=model, prompt="abc", logprobs=2, n=2, extra_body=KEYS)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        lp = choice.logprobs
        n = len(lp.tokens)
        assert n and len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert "".join(_visible(t) for t in lp.tokens) == choice.text
        assert all(len(top) <= 2 and max(top.values()) >= v - 1e-5 for top, v in
                   zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # fmt: skip
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert len(lp.model_extra["steps"]) == n
    assert r.choices[0].logprobs.tokens == r.choices[1].logprobs.tokens  # greedy: n equal

    stream = oai.completions.create(
        model=model, prompt="abc", logprobs=2, stream=True, extra_body=KEYS
    )
    tokens, values, offsets, steps = [], [], [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
                steps += c.logprobs.model_extra["steps"]
    want = r.choices[0].logprobs
    assert tokens == want.tokens and offsets == want.text_offset
    assert steps == want.model_extra["steps"]
    assert values == pytest.approx(want.token_logprobs, abs=1e-5)


def test_logprobs_errors_name_the_field(oai: openai.OpenAI, model: str) -> None:
    for kw, field in (
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=model, messages=MSG, max_tokens=8, **kw)
        assert err.value.body["param"] == field, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="x", max_tokens=8, logprobs=21)
    assert err.value.body["param"] == "logprobs"


def test_logprobs_over_triton_grpc_and_http(oai: openai.OpenAI, client: DLMClient) -> None:
    proxied = oai.chat.completions.create(
        model=client.model, messages=MSG, logprobs=True, top_logprobs=2, extra_body=KEYS
    )
    want = [(t.token, t.model_extra["step"]) for t in proxied.choices[0].logprobs.content]
    for out in (
        client.generate(messages=MSG, logprobs=2, **KEYS),
        client.generate(messages=MSG, logprobs=2, stream=True, **KEYS),
        client.generate_http(messages=MSG, logprobs=2, **KEYS),
        client.generate_http(messages=MSG, logprobs=2, stream=True, **KEYS),
    ):
        assert [(e["token"], e["step"]) for e in out.logprobs] == want
        assert all(len(e["top_logprobs"]) == 2 for e in out.logprobs)
        assert [e["token_id"] for e in out.logprobs]
    assert client.generate(messages=MSG, **KEYS).logprobs is None
