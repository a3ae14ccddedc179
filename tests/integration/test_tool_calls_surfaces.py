"""Tool calls through every surface: the real proxy with the official `openai`
client (`tools`, `tool_choice` none / auto / required / a named function, streamed and not,
the client's `parse` helper with a pydantic tool, tool results sent back), and Triton gRPC and
HTTP through `dlm_client`. The session model is a random-weight LLaDA: with `required` or a
named function the arguments must parse and validate whatever the weights."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import proxy_fixtures
import pytest
from dlm_client import DLMClient
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration

proxy = proxy_fixtures.proxy
oai = proxy_fixtures.oai
model = proxy_fixtures.model

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SUM = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
    "required": ["values"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": SUM}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
    for n, s in SCHEMAS.items()
]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function(oai: openai.OpenAI, model: str) -> None:
    for seed in range(2):
        r = oai.chat.completions.create(
            model=model,
            messages=MSG,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=128,
            temperature=1.0,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls, {"get_weather"})


def test_required_streamed(oai: openai.OpenAI, model: str) -> None:
    stream = oai.chat.completions.create(
        model=model, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=160,
        stream=True, extra_body={"block_length": 32},
    )  # fmt: skip
    calls, content, reasons = {}, "", []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                calls[tc.index] = tc
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and content == ""
    _valid([calls[i] for i in sorted(calls)], set(SCHEMAS))


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


def test_parse_helper_with_a_pydantic_tool(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.parse(
        model=model,
        messages=MSG,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        max_tokens=128,
    )
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_auto_and_none(oai: openai.OpenAI, model: str) -> None:
    """`auto`: a call in the template's format becomes `tool_calls` (a grammar makes this random
    model write one after some text); the streamed content stops before it. `none`: no tools."""
    call = '<tool_call>\n{"name": "add", "arguments": {"values": [1, 2]}}\n</tool_call>'
    grammar = f"start: {json.dumps('Adding.' + chr(10) + call)}"
    keys = {"max_tokens": 128, "extra_body": {"grammar": grammar, "block_length": 8}}
    r = oai.chat.completions.create(model=model, messages=MSG, tools=TOOLS, **keys)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Adding.\n"
    assert json.loads(message.tool_calls[0].function.arguments) == {"values": [1, 2]}
    stream = oai.chat.completions.create(
        model=model, messages=MSG, tools=TOOLS, stream=True, **keys
    )
    pieces = [c.delta.content for ch in stream for c in ch.choices if c.delta.content]
    assert "".join(pieces) == "Adding.\n" and len(pieces) > 1
    r = oai.chat.completions.create(model=model, messages=MSG, tools=TOOLS, tool_choice="none",
                                    **keys)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("Adding.\n<tool_call>")


def test_tool_results_go_back(oai: openai.OpenAI, model: str) -> None:
    first = oai.chat.completions.create(
        model=model, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=128
    )
    asked = first.choices[0].message
    history = [
        *MSG,
        asked,  # the client's own message object, as apps send it back
        *(
            {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"}
            for c in asked.tool_calls
        ),
    ]
    r = oai.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=16, extra_body={"steps": 8}
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in


def test_tool_errors_name_the_field(oai: openai.OpenAI, model: str) -> None:
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "integer", "minimum": 3, "maximum": 1}}}], "tool_choice": "required"},
         "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ]  # fmt: skip
    for kw, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=model, messages=MSG, max_tokens=8, **kw)
        assert err.value.body["param"] == field, (kw, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="x", max_tokens=8, extra_body={"tools": TOOLS})
    assert err.value.body["param"] == "tools"


def test_tools_over_triton_grpc_and_http(client: DLMClient) -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    for out in (
        client.generate(messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=96),
        client.generate(
            messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=96, stream=True
        ),  # fmt: skip
        client.generate_http(messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=96),
    ):
        assert out.finish_reason == "tool_calls", out.text
        for call in out.tool_calls:
            jsonschema.validate(
                json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
            )
