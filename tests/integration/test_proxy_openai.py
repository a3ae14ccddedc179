"""The official `openai` client against the real proxy and a real tritonserver (tiny model).

Covers the API's acceptance criteria: chat and completions, prompt shapes, n > 1, stop strings,
usage, finish_reason, seeds, streaming (sync and async) equal to non-streamed text, denoise
events, diffusion fields and Triton-side validation surfacing as 400.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import proxy_fixtures
import pytest
from proxy_fixtures import ProxyProcess

pytestmark = pytest.mark.integration

# Fixtures shared by the proxy tests (the Triton ones come from conftest.py).
proxy = proxy_fixtures.proxy
oai = proxy_fixtures.oai
model = proxy_fixtures.model

MSG = [{"role": "user", "content": "Say something."}]
PROMPTS = ["hello", "The quick brown fox", "1 2 3 4", "abc", "diffusion"]


def chat_text(r: Any, i: int = 0) -> str:
    return r.choices[i].message.content


def test_models_list_and_retrieve(oai: openai.OpenAI, model: str) -> None:
    ids = [m.id for m in oai.models.list()]
    assert model in ids
    card = oai.models.retrieve(model)
    assert card.id == model and card.object == "model"


def test_unknown_model_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4o", messages=MSG)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_chat_completion_shape_usage_and_finish_reason(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(model=model, messages=MSG, max_tokens=16)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model
    assert r.created > 0
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None and u.prompt_tokens > 0
    assert 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if choice.finish_reason == "length":
        assert u.completion_tokens == 16  # the whole canvas holds real tokens


def test_max_completion_tokens_and_aliases(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(model=model, messages=MSG, max_completion_tokens=8)
    assert r.usage.completion_tokens <= 8
    r = oai.chat.completions.create(
        model=model, messages=MSG, extra_body={"gen_length": 8, "diffusion_steps": 4}
    )
    assert r.usage.completion_tokens <= 8


def test_completion_prompt_shapes(oai: openai.OpenAI, model: str) -> None:
    one = oai.completions.create(model=model, prompt="hello", max_tokens=8)
    assert one.object == "text_completion" and one.id.startswith("cmpl-")
    assert len(one.choices) == 1 and one.choices[0].finish_reason in ("stop", "length")

    many = oai.completions.create(model=model, prompt=["hello", "abc"], max_tokens=8)
    assert [c.index for c in many.choices] == [0, 1]
    # Greedy: choice 0 of the batch is the single "hello" completion.
    assert many.choices[0].text == one.choices[0].text
    abc = oai.completions.create(model=model, prompt="abc", max_tokens=8)
    assert many.choices[1].text == abc.choices[0].text
    assert many.usage.prompt_tokens == one.usage.prompt_tokens + abc.usage.prompt_tokens
    completions = one.usage.completion_tokens + abc.usage.completion_tokens
    assert many.usage.completion_tokens == completions

    ids = oai.completions.create(model=model, prompt=[10, 11, 12, 13], max_tokens=8)
    assert len(ids.choices) == 1 and ids.usage.prompt_tokens == 4

    id_lists = oai.completions.create(model=model, prompt=[[10, 11], [12, 13, 14]], max_tokens=8)
    assert [c.index for c in id_lists.choices] == [0, 1]
    assert id_lists.usage.prompt_tokens == 5


def test_n_choices_follow_seed_plus_i(oai: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "messages": MSG, "max_tokens": 16, "temperature": 1.0}
    r = oai.chat.completions.create(n=3, seed=42, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    singles = [oai.chat.completions.create(seed=42 + i, **kw) for i in range(3)]
    for i, single in enumerate(singles):
        assert chat_text(r, i) == chat_text(single), f"choice {i} != single request seed+{i}"
    # Prompt counted once; completions summed.
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_completions_over_several_prompts(oai: openai.OpenAI, model: str) -> None:
    r = oai.completions.create(
        model=model, prompt=["hello", "abc"], n=2, max_tokens=8, temperature=1.0, seed=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt * n + i


def test_seed_reproducibility(oai: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "prompt": "hello", "max_tokens": 24, "temperature": 1.0}
    a = oai.completions.create(seed=7, **kw).choices[0].text
    b = oai.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    others = {oai.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)}
    assert others != {a}, "different seeds should sample differently at temperature 1"


def _stop_case(oai: openai.OpenAI, model: str) -> tuple[str, str, str]:
    """A greedy completion and a stop string inside it (first occurrence after index 1)."""
    for prompt in PROMPTS:
        text = oai.completions.create(model=model, prompt=prompt, max_tokens=32).choices[0].text
        for k in range(2, len(text)):
            if text[k] not in text[:k] and text[k].strip():
                return prompt, text, text[k]
    pytest.skip("the tiny model produced no text with a usable stop character")


def test_stop_strings_end_the_text(oai: openai.OpenAI, model: str) -> None:
    prompt, full, stop = _stop_case(oai, model)
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=32, stop=[stop])
    choice = r.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    # Also through chat with a single string.
    r2 = oai.completions.create(model=model, prompt=prompt, max_tokens=32, stop=stop)
    assert r2.choices[0].text == choice.text


def test_streamed_chat_deltas_concatenate_to_the_full_text(oai: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "messages": MSG, "max_tokens": 32}
    full = oai.chat.completions.create(**kw)
    chunks = list(
        oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" and c.model == model for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_text(full)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    # include_usage: a last chunk with no choices and the same usage as the full call.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completions_n2_per_index(oai: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {
        "model": model, "prompt": "hello", "max_tokens": 24, "n": 2, "seed": 5, "temperature": 1.0
    }  # fmt: skip
    full = oai.completions.create(**kw)
    texts = {0: "", 1: ""}
    reasons = {}
    for chunk in oai.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}


def test_stream_without_usage_option_has_no_usage_chunk(oai: openai.OpenAI, model: str) -> None:
    chunks = list(oai.completions.create(model=model, prompt="abc", max_tokens=8, stream=True))
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_denoise_stream_carries_canvas_snapshots(oai: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "prompt": "hello", "max_tokens": 16}
    delta_text = "".join(
        c.choices[0].text
        for c in oai.completions.create(stream=True, extra_body={"steps": 8}, **kw)
    )
    canvases, steps, text = [], [], ""
    for chunk in oai.completions.create(
        stream=True, extra_body={"steps": 8, "stream_mode": "denoise"}, **kw
    ):
        choice = chunk.choices[0]
        text += choice.text
        extra = choice.model_extra or {}
        if "canvas" in extra:
            canvases.append(extra["canvas"])
            steps.append(extra["steps"])
    assert len(canvases) >= 2, "denoise mode should send a snapshot per step"
    assert all(len(c) == 16 for c in canvases)
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    masked = [sum(t is None for t in c) for c in canvases]
    assert masked == sorted(masked, reverse=True), "positions are only ever unmasked"
    assert text == delta_text, "denoise mode streams the same committed text"


def test_denoise_chat_via_raw_sse(proxy: ProxyProcess, model: str) -> None:
    """What a visualiser sees: data lines with choices[].canvas, then [DONE]."""
    body = {
        "model": model, "messages": MSG, "max_tokens": 8, "steps": 4,
        "stream": True, "stream_mode": "denoise",
    }  # fmt: skip
    lines = []
    with httpx.stream("POST", proxy.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert any("canvas" in e["choices"][0] for e in events if e["choices"])


def test_diffusion_fields_validated_by_the_model_are_400(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(
            model=model, prompt="x", max_tokens=10, extra_body={"block_length": 3}
        )
    assert info.value.param == "block_length"
    assert "invalid request:" in info.value.message
    # Streaming too: the model's immediate error becomes a real 400, not a broken stream.
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(
            model=model, messages=MSG, max_tokens=10, stream=True, extra_body={"block_length": 3}
        )


def test_diffusion_fields_pass_through(oai: openai.OpenAI, model: str) -> None:
    r = oai.completions.create(
        model=model,
        prompt="hello",
        max_tokens=16,
        extra_body={"steps": 4, "block_length": 8, "algorithm": "random", "seed": 1},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    r = oai.completions.create(
        model=model,
        prompt="hello",
        max_tokens=16,
        extra_body={"threshold": 0.5, "block_length": 16},
    )
    assert r.choices[0].finish_reason in ("stop", "length")


def test_accelerated_decoding_fields_pass_through(oai: openai.OpenAI, model: str) -> None:
    """dlmserve's LocalLeap fields and d3LLM's multi-block keys reach the engine;
    a bad combination is a 400 naming the field."""
    for extra in (
        {"use_local_leap": True, "local_leap_radius": 2, "force_single_batch": True},
        {"multi_block": True, "threshold": 0.4, "block_size": 8, "decoded_token_threshold": 0.9},
        {"algorithm": "factor", "factor": 2.0},
    ):
        r = oai.completions.create(model=model, prompt="hello", max_tokens=16, extra_body=extra)
        assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(
            model=model,
            prompt="x",
            max_tokens=16,
            extra_body={"block_add_threshold": 0.5, "multi_block": False},
        )
    assert info.value.param == "block_add_threshold"


def test_unsupported_openai_fields_are_400(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=MSG, presence_penalty=0.5)
    assert info.value.param == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as info:  # supported, but not "xml"
        oai.chat.completions.create(model=model, messages=MSG, response_format={"type": "xml"})
    assert (info.value.param or "").startswith("response_format")
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model, prompt="x", echo=True)


def test_async_client_concurrent_calls_equal_sequential(
    proxy: ProxyProcess, oai: openai.OpenAI, model: str
) -> None:
    """Concurrent greedy requests (batched in Triton) give the same text as one at a time."""
    prompts = PROMPTS[:4]
    sequential = [
        oai.completions.create(model=model, prompt=p, max_tokens=16).choices[0].text
        for p in prompts
    ]

    async def run() -> tuple[list[str], str, str]:
        client = proxy.async_client()
        try:
            texts = await asyncio.gather(
                *(client.completions.create(model=model, prompt=p, max_tokens=16) for p in prompts)
            )
            stream = await client.chat.completions.create(
                model=model, messages=MSG, max_tokens=16, stream=True
            )
            streamed = "".join(
                [c.choices[0].delta.content or "" async for c in stream if c.choices]
            )
            full = await client.chat.completions.create(model=model, messages=MSG, max_tokens=16)
            return [t.choices[0].text for t in texts], streamed, full.choices[0].message.content
        finally:
            await client.close()

    concurrent, streamed, full = asyncio.run(run())
    assert concurrent == sequential
    assert streamed == full
