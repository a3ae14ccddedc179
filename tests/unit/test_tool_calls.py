"""Tool calls in the engine (issue 17): the tools reach the prompt through the chat template
(Dream's Qwen2.5-style template) or a system message (LLaDA's has none); `required` and a named
function give calls whose arguments parse and validate against the function's schema on
random-weight LLaDA and Dream layouts; `auto` parses calls from the text and streams no part of
them as content; tool results and earlier calls go back through the template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dlm_engine import Engine, InvalidRequestError, RequestOutput

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SCHEMAS = {
    "get_weather": WEATHER,
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -50, "maximum": 50},
            "b": {"type": "number"},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "guests": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"}},
                    "required": ["name"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
            "vip": {"type": "boolean"},
        },
        "required": ["guests"],
        "additionalProperties": False,
    },
    "noop": None,  # no parameters: any object
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "description": f"{n} tool", **({"parameters": s} if s else {})},
    }
    for n, s in SCHEMAS.items()
]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def _run(eng: Engine, params: dict, messages=MSG) -> list[RequestOutput]:
    resolved = eng.resolve_params(params)
    prompt = eng.encode_prompt(messages=messages, tools=resolved.tools)
    rid = eng.add_request(None, prompt, resolved)
    return [o for o in eng.outputs() if o.request_id == rid]


def _validate(calls: list[dict], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in allowed
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[name] or {"type": "object"})


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_named_function_arguments_always_validate(
    engines: dict[str, Engine], family: str, name: str
) -> None:
    choice = {"type": "function", "function": {"name": name}}
    outs = _run(engines[family], {"max_tokens": 128, "tools": TOOLS, "tool_choice": choice})
    final = outs[-1]
    assert final.finish_reason == "tool_calls", final.text
    assert len(final.tool_calls) == 1
    _validate(final.tool_calls, {name})
    assert final.text == "" and all(o.delta_text == "" for o in outs)  # no call text as content


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate(engines: dict[str, Engine], family: str, parallel: bool) -> None:
    for seed in range(2):
        params = {"max_tokens": 192, "tools": TOOLS, "tool_choice": "required", "seed": seed,
                  "temperature": 1.0, "parallel_tool_calls": parallel}  # fmt: skip
        final = _run(engines[family], params)[-1]
        assert final.finish_reason == "tool_calls", final.text
        _validate(final.tool_calls, set(SCHEMAS))
        if not parallel:
            assert len(final.tool_calls) == 1


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def test_auto_parses_a_call_and_streams_only_the_content(engines: dict[str, Engine]) -> None:
    """`auto` leaves the text free; a grammar here makes the model write a call after some
    text, as a model that knows the format would."""
    grammar = f"start: {json.dumps('Let me check.')} {json.dumps(chr(10) + CALL)}"
    params = {"max_tokens": 128, "block_length": 8, "tools": TOOLS, "grammar": grammar}
    outs = _run(engines["llada"], params)
    final = outs[-1]
    assert final.finish_reason == "tool_calls"
    assert final.text == "Let me check.\n"
    assert "".join(o.delta_text for o in outs) == final.text
    assert len(outs) > 2 and not any("<" in o.delta_text for o in outs)
    assert [json.loads(c["function"]["arguments"]) for c in final.tool_calls] == [
        {"city": "Paris", "unit": "celsius"}
    ]


def test_auto_without_a_call_is_plain_content(engines: dict[str, Engine]) -> None:
    grammar = 'start: "The <tool_ answer is 4."'  # looks like a call's start, then is not
    outs = _run(engines["llada"], {"max_tokens": 64, "tools": TOOLS, "grammar": grammar})
    final = outs[-1]
    assert final.finish_reason == "stop" and final.tool_calls is None
    assert "".join(o.delta_text for o in outs) == final.text == "The <tool_ answer is 4."


def test_tool_choice_none_and_parallel_false_in_auto(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    two = f"start: {json.dumps(CALL + chr(10) + CALL)}"
    final = _run(eng, {"max_tokens": 256, "tools": TOOLS, "grammar": two})[-1]
    assert len(final.tool_calls) == 2 and final.tool_calls[0]["id"] != final.tool_calls[1]["id"]
    final = _run(eng, {"max_tokens": 256, "tools": TOOLS, "grammar": two,
                       "parallel_tool_calls": False})[-1]  # fmt: skip
    assert len(final.tool_calls) == 1
    final = _run(eng, {"max_tokens": 256, "tools": TOOLS, "grammar": two, "tool_choice": "none"})[
        -1
    ]
    assert (
        final.tool_calls is None
        and final.finish_reason == "stop"
        and final.text.startswith("<tool_call>")
    )


def test_tools_reach_the_prompt(engines: dict[str, Engine]) -> None:
    history = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"},
    ]  # fmt: skip
    for family in ("dream", "llada"):
        eng = engines[family]
        spec = eng.resolve_params({"tools": TOOLS}).tools
        text = eng.tokenizer.decode(eng.encode_prompt(messages=history, tools=spec))
        assert "# Tools" in text and json.dumps(TOOLS[0], ensure_ascii=False) in text, family
        assert (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
            in text
        )
        assert "<tool_response>\nsunny, 21\n</tool_response>" in text
        plain = eng.tokenizer.decode(eng.encode_prompt(messages=history))
        assert "# Tools" not in plain and "<tool_response>" in plain  # history without tools
        none = eng.resolve_params({"tools": TOOLS, "tool_choice": "none"}).tools
        assert none is None


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "integer", "minimum": 5, "maximum": 1},
                    },
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("params", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_tool_requests_name_the_field(
    engines: dict[str, Engine], params: dict, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["llada"].resolve_params(params)
    assert err.value.field == field


def test_tool_messages_are_checked(engines: dict[str, Engine]) -> None:
    eng = engines["dream"]
    bad = [
        [{"role": "user", "content": None}],
        [
            {
                "role": "user",
                "content": "x",
                "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
            }
        ],
        [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
    ]
    for messages in bad:
        with pytest.raises(InvalidRequestError) as err:
            eng.encode_prompt(messages=messages)
        assert err.value.field == "messages"


def test_arguments_are_json_as_written(engines: dict[str, Engine]) -> None:
    """A grammar-valid number too large for a float stays valid JSON (no `Infinity`, which a
    JSON client cannot read); NaN written by a free model is no call."""
    huge = '<tool_call>\n{"name": "add", "arguments": {"a": 1e999, "b": -2.50}}\n</tool_call>'
    final = _run(
        engines["llada"],
        {"max_tokens": 128, "tools": TOOLS, "grammar": f"start: {json.dumps(huge)}"},
    )[-1]
    args = final.tool_calls[0]["function"]["arguments"]
    assert "Infinity" not in args and json.loads(args, parse_float=str) == {
        "a": "1e999",
        "b": "-2.50",
    }
    nan = '<tool_call>\n{"name": "add", "arguments": {"a": NaN, "b": 1}}\n</tool_call>'
    final = _run(
        engines["llada"],
        {"max_tokens": 128, "tools": TOOLS, "grammar": f"start: {json.dumps(nan)}"},
    )[-1]
    assert final.tool_calls is None and final.text == nan
