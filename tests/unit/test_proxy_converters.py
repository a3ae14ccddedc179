"""OpenAI request -> Triton jobs, and results -> OpenAI bodies (no server involved)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openai_proxy.config import ProxyConfig
from openai_proxy.converters import (
    ChoiceResult,
    chat_jobs,
    chat_response,
    completion_jobs,
    completion_response,
    messages_json,
    openai_finish_reason,
    sampling_parameters,
    usage_of,
)
from openai_proxy.errors import InvalidRequest
from openai_proxy.schemas import ChatCompletionRequest, CompletionRequest

LIMITS = ProxyConfig(max_tokens_limit=512, max_n=4, max_fanout=6)


def chat(**kw: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return ChatCompletionRequest.model_validate(body)


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "p", **kw})


def test_only_given_keys_are_sent() -> None:
    assert sampling_parameters(chat(), 0, LIMITS) == {}


def test_all_keys_map_to_the_contract() -> None:
    req = chat(
        max_tokens=32,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop="END",
        remasking="random",
        diffusion_steps=16,
        block_size=8,
        threshold=0.9,
        alg_temp=0.1,
        cfg_scale=1.5,
        suppress_eos=True,
        cache="prefix",
        stream=True,
        stream_mode="denoise",
    )
    assert sampling_parameters(req, 0, LIMITS) == {
        "max_tokens": 32,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 11,
        "stop": ["END"],
        "algorithm": "random",
        "steps": 16,
        "block_length": 8,
        "threshold": 0.9,
        "alg_temp": 0.1,
        "cfg_scale": 1.5,
        "suppress_eos": True,
        "cache": "prefix",
        "stream_mode": "denoise",
    }


def test_max_completion_tokens_becomes_max_tokens() -> None:
    assert sampling_parameters(chat(max_completion_tokens=9), 0, LIMITS) == {"max_tokens": 9}


def test_max_tokens_limit() -> None:
    with pytest.raises(InvalidRequest) as info:
        sampling_parameters(chat(max_tokens=513), 0, LIMITS)
    assert info.value.param == "max_tokens" and "512" in info.value.message


def test_n_choices_get_seed_plus_i() -> None:
    jobs = chat_jobs(chat(n=3, seed=100, temperature=1.0), "chatcmpl-x", LIMITS)
    assert [j.choice_index for j in jobs] == [0, 1, 2]
    assert [j.sampling_parameters["seed"] for j in jobs] == [100, 101, 102]
    assert [j.request_id for j in jobs] == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert all(j.prompt_input == "messages" and j.stream is False for j in jobs)


def test_unseeded_choices_stay_unseeded() -> None:
    jobs = chat_jobs(chat(n=2), "id", LIMITS)
    assert all("seed" not in j.sampling_parameters for j in jobs)


def test_n_and_fanout_limits() -> None:
    with pytest.raises(InvalidRequest, match="n=5"):
        chat_jobs(chat(n=5), "id", LIMITS)
    with pytest.raises(InvalidRequest, match="8 generations"):
        completion_jobs(completion(prompt=["a", "b", "c", "d"], n=2), "id", LIMITS)


def test_messages_json_flattens_parts_and_developer_role() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}],
            },
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "ünïcode"},
        ]
    )
    assert json.loads(messages_json(req)) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "ünïcode"},
    ]


def test_completion_prompts_map_to_inputs_and_indices() -> None:
    jobs = completion_jobs(completion(prompt=["a", "b"], n=2, seed=5), "cmpl-y", LIMITS)
    assert [(j.prompt_index, j.choice_index) for j in jobs] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert [j.prompt_value for j in jobs] == ["a", "a", "b", "b"]
    assert all(j.prompt_input == "text_input" for j in jobs)
    # seed + i restarts per prompt: choice i of every prompt samples alike.
    assert [j.sampling_parameters["seed"] for j in jobs] == [5, 6, 5, 6]

    ids = completion_jobs(completion(prompt=[[1, 2], [3]]), "c", LIMITS)
    assert [(j.prompt_input, j.prompt_value) for j in ids] == [
        ("input_ids", [1, 2]),
        ("input_ids", [3]),
    ]
    single = completion_jobs(completion(prompt=[7, 8, 9], stream=True), "c", LIMITS)
    assert len(single) == 1 and single[0].prompt_value == [7, 8, 9] and single[0].stream


def test_finish_reasons() -> None:
    assert openai_finish_reason("stop") == "stop"
    assert openai_finish_reason("length") == "length"
    assert openai_finish_reason("abort") is None
    assert openai_finish_reason("") is None


def test_usage_counts_each_prompt_once() -> None:
    results = [
        ChoiceResult(0, 0, "a", "stop", prompt_tokens=10, completion_tokens=3),
        ChoiceResult(1, 0, "b", "length", prompt_tokens=10, completion_tokens=4),
        ChoiceResult(2, 1, "c", "stop", prompt_tokens=6, completion_tokens=1),
    ]
    assert usage_of(results) == {"prompt_tokens": 16, "completion_tokens": 8, "total_tokens": 24}


def test_response_bodies_sorted_by_index() -> None:
    results = [
        ChoiceResult(1, 0, "second", "length", 5, 2),
        ChoiceResult(0, 0, "first", "stop", 5, 1),
    ]
    body = chat_response("chatcmpl-1", 123, "m", results)
    assert body["object"] == "chat.completion" and body["created"] == 123
    assert [c["message"]["content"] for c in body["choices"]] == ["first", "second"]
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["total_tokens"] == 8
    text = completion_response("cmpl-1", 123, "m", results)
    assert text["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in text["choices"]] == [
        (0, "first", "stop"),
        (1, "second", "length"),
    ]


def test_acceleration_keys_and_seed_aliases_reach_the_engine() -> None:
    """LocalLeap (with dlmserve's names), multi-block and factor keys pass through."""
    req = chat(
        use_local_leap=True,
        local_leap_anchor_threshold=0.8,
        local_leap_neighbor_threshold=0.6,
        local_leap_radius=3,
        force_single_batch=True,
    )
    assert sampling_parameters(req, 0, LIMITS) == {
        "use_local_leap": True,
        "anchor_threshold": 0.8,
        "neighbor_threshold": 0.6,
        "leap_radius": 3,
        "force_single_batch": True,
    }
    req = chat(multi_block=True, threshold=0.5, block_add_threshold=0.1,
               decoded_token_threshold=0.95, max_active_blocks=4)  # fmt: skip
    assert sampling_parameters(req, 0, LIMITS) == {
        "multi_block": True,
        "threshold": 0.5,
        "block_add_threshold": 0.1,
        "decoded_token_threshold": 0.95,
        "max_active_blocks": 4,
    }
    assert sampling_parameters(chat(algorithm="factor", factor=1.0), 0, LIMITS) == {
        "algorithm": "factor",
        "factor": 1.0,
    }
