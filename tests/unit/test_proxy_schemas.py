"""Request validation of the OpenAI proxy: what is accepted, what gets a clear 400."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from openai_proxy.schemas import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**CHAT, **kw})


def chat_error(**kw: Any) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as info:
        chat(**kw)
    err = info.value.errors()[0]
    return err["loc"], err["msg"]


def test_minimal_chat_defaults() -> None:
    req = chat()
    assert req.n == 1 and req.stream is False
    assert req.effective_max_tokens() is None
    assert req.stop_list() == []
    assert req.include_usage() is False


@pytest.mark.parametrize(
    ("alias", "field", "value"),
    [
        ("max_new_tokens", "max_tokens", 16),
        ("gen_length", "max_tokens", 16),
        ("num_denoising_steps", "steps", 8),
        ("diffusion_steps", "steps", 8),
        ("remasking", "algorithm", "random"),
        ("alg", "algorithm", "entropy"),
        ("block_size", "block_length", 4),
    ],
)
def test_aliases_fill_canonical_fields(alias: str, field: str, value: Any) -> None:
    assert getattr(chat(**{alias: value}), field) == value


def test_conflicting_aliases_rejected() -> None:
    _, msg = chat_error(steps=4, diffusion_steps=8)
    assert "conflicting values for steps" in msg


def test_same_value_under_two_aliases_is_fine() -> None:
    assert chat(steps=4, diffusion_steps=4).steps == 4


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
        ({"steps": 0}, "steps"),
        ({"block_length": 0}, "block_length"),
        ({"threshold": 0}, "threshold"),
        ({"threshold": 25}, "threshold"),
        ({"alg_temp": -1}, "alg_temp"),
        ({"cfg_scale": -0.5}, "cfg_scale"),
        ({"algorithm": "beam"}, "algorithm"),
        ({"stream_mode": "tokens", "stream": True}, "stream_mode"),
        ({"cache": "kv"}, "cache"),
    ],
)
def test_out_of_range_values_name_the_field(kw: dict[str, Any], field: str) -> None:
    loc, _ = chat_error(**kw)
    assert loc[0] == field


@pytest.mark.parametrize(
    "kw",
    [
        {"functions": [{"name": "f"}]},
        {"reasoning_effort": "low"},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -1},
        {"audio": {"voice": "x"}},
        {"modalities": ["text", "audio"]},
        {"web_search_options": {}},
    ],
)
def test_unsupported_openai_features_rejected(kw: dict[str, Any]) -> None:
    loc, msg = chat_error(**kw)
    name = next(iter(kw))
    assert loc == (name,)
    assert "not supported" in msg


@pytest.mark.parametrize(
    "kw",
    [
        {"logprobs": False},
        {"presence_penalty": 0},
        {"frequency_penalty": 0.0},
        {"tools": []},
        {"tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"logit_bias": {}},
        {"parallel_tool_calls": True},
        {"user": "alice"},
    ],
)
def test_neutral_values_chat_uis_send_are_accepted(kw: dict[str, Any]) -> None:
    chat(**kw)


def test_framework_fields_are_accepted_and_ignored() -> None:
    """What LangChain and the OpenAI Agents SDK send with every request (tests/integration/
    test_framework_shapes.py sends them whole)."""
    meta = {f"k{i}": "v" * 512 for i in range(16)} | {"x" * 64: ""}
    meta.pop("k0")
    req = chat(metadata=meta, store=True, service_tier="auto", user="u", prompt_cache_key="c")
    assert req.metadata == meta and req.store is True
    chat(store=False, service_tier="flex", metadata={}, parallel_tool_calls=False)


@pytest.mark.parametrize(
    "kw",
    [
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"x" * 65: "v"}},
        {"metadata": {"k": "v" * 513}},
        {"metadata": {"k": 1}},
        {"metadata": ["k"]},
        {"metadata": "k=v"},
        {"store": "true"},
        {"service_tier": "gold"},
    ],
)
def test_framework_fields_keep_openais_shape(kw: dict[str, Any]) -> None:
    loc, _ = chat_error(**kw)
    assert loc == (next(iter(kw)),)  # the field itself, never an inner key


def test_logit_bias_is_a_contract_key() -> None:
    assert chat(logit_bias={"42": -100, "7": 5.5}).logit_bias == {"42": -100, "7": 5.5}
    for bad in ({"42": 101}, {"a": 1}, {"42": "1"}, [42], {"-1": 0}):
        loc, msg = chat_error(logit_bias=bad)
        assert loc == ("logit_bias",), bad
        assert "token" in msg or "object" in msg


def test_unknown_field_rejected() -> None:
    loc, msg = chat_error(temprature=0.5)
    assert loc == ("temprature",)
    assert "Extra inputs" in msg


def test_denoise_needs_stream() -> None:
    _, msg = chat_error(stream_mode="denoise")
    assert "needs stream=true" in msg
    assert chat(stream_mode="denoise", stream=True).stream_mode == "denoise"


def test_stream_options_need_stream() -> None:
    _, msg = chat_error(stream_options={"include_usage": True})
    assert "stream=true" in msg
    req = chat(stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert req.include_usage() is True


def test_stop_strings() -> None:
    assert chat(stop="END").stop_list() == ["END"]
    assert chat(stop=["a", "b"]).stop_list() == ["a", "b"]
    assert "empty" in chat_error(stop=[""])[1]
    assert "at most 16" in chat_error(stop=[str(i) for i in range(17)])[1]


def test_messages_validation() -> None:
    assert chat_error(messages=[])[0] == ("messages",)
    loc, msg = chat_error(messages=[{"role": "function", "content": "x", "name": "f"}])
    assert loc == ("messages", 0, "role") and "tool" in msg
    # tool results and assistant calls
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = chat(messages=[{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": "x", "tool_call_id": "c1"}])  # fmt: skip
    assert req.messages[0].tool_calls[0].function.name == "f"
    assert chat_error(messages=[{"role": "tool", "content": "x"}])[0] == ("messages", 0, "content")
    loc, msg = chat_error(messages=[{"role": "user", "content": "x", "tool_calls": [call]}])
    assert loc == ("messages", 0, "content") and "assistant" in msg
    loc, msg = chat_error(messages=[{"role": "wizard", "content": "x"}])
    assert "role must be one of" in msg
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    loc, msg = chat_error(messages=[{"role": "user", "content": [image]}])
    assert loc == ("messages", 0, "content") and "image_url" in msg
    assert chat_error(messages=[{"role": "user"}])[0] == ("messages", 0, "content")


def test_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "user", "content": parts}])
    assert req.messages[0].text() == "ab"


def test_max_completion_tokens() -> None:
    assert chat(max_completion_tokens=12).effective_max_tokens() == 12
    assert chat(max_tokens=12, max_completion_tokens=12).effective_max_tokens() == 12
    assert "disagree" in chat_error(max_tokens=8, max_completion_tokens=12)[1]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_shapes(prompt: Any, expected: list) -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert req.prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[]], [-1], 5, [True], ["a", 1], [[1], "a"], None])
def test_bad_completion_prompts(prompt: Any) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    errors = info.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == ("prompt",)


@pytest.mark.parametrize("kw", [{"echo": True}, {"best_of": 3}, {"suffix": "x"}])
def test_completion_unsupported(kw: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "p", **kw})
    assert "not supported" in info.value.errors()[0]["msg"]


def test_completion_neutral_legacy_fields() -> None:
    CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "echo": False, "best_of": 1, "logprobs": None}
    )


def test_logprobs_map_to_the_contract_key() -> None:
    """Chat `logprobs: true` + `top_logprobs`, completions `logprobs: N`."""

    def chat(**kw: Any) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({**CHAT, **kw})

    assert chat().logprobs_key() is None
    assert chat(logprobs=False).logprobs_key() is None
    assert chat(logprobs=False, top_logprobs=0).logprobs_key() is None
    assert chat(logprobs=True).logprobs_key() == 0
    assert chat(logprobs=True, top_logprobs=20).logprobs_key() == 20
    done = CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 5})
    assert done.logprobs_key() == 5
    for kw, field in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 4}, "logprobs"),  # a boolean, as OpenAI's chat: the count is top_logprobs
        ({"logprobs": "true"}, "logprobs"),
    ):
        with pytest.raises(ValidationError) as info:
            chat(**kw)
        assert field in str(info.value), kw
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": True})


def test_echo_with_max_tokens_0_scores_the_prompt() -> None:
    """Completions `echo: true` + `max_tokens: 0` = the contract's `score`."""
    from openai_proxy.config import ProxyConfig
    from openai_proxy.converters import sampling_parameters

    def comp(**kw: Any) -> CompletionRequest:
        return CompletionRequest.model_validate({"model": "m", "prompt": "p", **kw})

    req = comp(echo=True, max_tokens=0, mc_samples=64, logprobs=0)
    assert req.is_scoring()
    params = sampling_parameters(req, 0, ProxyConfig())
    assert params["score"] is True and params["mc_samples"] == 64 and "max_tokens" not in params
    assert not comp(max_tokens=4).is_scoring()
    for kw, field in (
        ({"echo": True}, "echo"),
        ({"echo": True, "max_tokens": 3}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": "yes", "max_tokens": 0}, "echo"),
    ):
        with pytest.raises(ValidationError) as info:
            comp(**kw)
        assert field in str(info.value), kw
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 0})
