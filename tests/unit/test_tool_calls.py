"""Tool calls in the engine: the tools reach the prompt through the chat template
(Dream's Qwen2.5-style template) or a system message (LLaDA's has none); `required` and a named
function give calls whose arguments parse and validate against the function's schema on
random-weight LLaDA and Dream layouts; `auto` parses calls from the text and streams no part of
them as content; tool results and earlier calls go back through the template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dlm_engine import Engine, InvalidRequestError, RequestOutput
from dlm_engine.tools import (
    TOOL_CALL_OPEN,
    ToolAnswer,
    ToolCallText,
    ToolSpec,
    parse_tool_calls,
    smallest_call,
)

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
    ({"tools": TOOLS + TOOLS[:1]}, "tools[4].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
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
    (  # a schema that cannot compile is named first, whatever the budget
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
            "max_tokens": 8,
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
    assert final.tool_calls is None and final.text == ""  # no call, and no markup as content


# ---- cut answers: no markup in content, whole calls returned, cut ones as they stand ----------

SPEC = ToolSpec(tuple(TOOLS), "auto")
NAMED = ToolSpec(tuple(TOOLS), "function", "get_weather")
ARGS = {"city": "Paris", "unit": "celsius"}


def _check_cut(answer: ToolAnswer, prefix: str, full_args_at: int) -> None:
    """One cut answer of `prefix` (a cut of `Sure.\\n` + CALL + `\\n` + CALL)."""
    assert "<" not in answer.content and answer.content == "Sure.\n"[: len(prefix)]
    if not answer.calls:
        return
    first = answer.calls[0]["function"]
    assert first["name"] == "get_weather"
    if len(prefix) >= full_args_at:  # the arguments are whole: the call is whole
        assert json.loads(first["arguments"]) == ARGS
    else:  # cut: the arguments as written so far, and the answer says so
        assert answer.cut and len(answer.calls) == 1
        assert CALL.startswith(
            f'<tool_call>\n{{"name": "get_weather", "arguments": {first["arguments"]}'
        )
    for call in answer.calls[1:]:
        assert call["function"]["name"] == "get_weather"
        args = call["function"]["arguments"]
        assert answer.cut or json.loads(args) == ARGS


def test_a_call_cut_anywhere_never_leaves_markup_in_content() -> None:
    text = "Sure.\n" + CALL + "\n" + CALL
    full_args_at = len("Sure.\n" + CALL) - len("}\n</tool_call>")
    for spec in (SPEC, NAMED):
        for n in range(len(text) + 1):
            prefix = text[:n]
            answer = parse_tool_calls(prefix, spec, cut=True)
            _check_cut(answer, prefix, full_args_at)
            if n > len("Sure.\n") + len('<tool_call>\n{"name": "get_weather"'):
                assert answer.calls, prefix  # the name is known: the call is there
            # without `cut` (the model stopped there): whole calls only, never markup
            whole = parse_tool_calls(prefix, spec)
            assert TOOL_CALL_OPEN not in whole.content and not whole.cut
            assert all(json.loads(c["function"]["arguments"]) == ARGS for c in whole.calls)
    named_start = parse_tool_calls('<tool_call>\n{"na', NAMED, cut=True)
    assert named_start.calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    # several functions begin with the cut name (or none is named yet): no call to guess
    two = ToolSpec(tuple(TOOLS), "required")
    assert parse_tool_calls('<tool_call>\n{"name": "', two, cut=True).calls == []
    assert (
        parse_tool_calls('<tool_call>\n{"name": "ad', two, cut=True).calls[0]["function"]["name"]
        == "add"
    )


def test_malformed_calls_are_dropped_not_shown() -> None:
    bad = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    answer = parse_tool_calls("Hi " + bad + "\n" + CALL, SPEC)
    assert answer.content == "Hi " and answer.markup
    assert [json.loads(c["function"]["arguments"]) for c in answer.calls] == [ARGS]
    assert parse_tool_calls("Hi " + bad, SPEC).calls == []
    assert parse_tool_calls("no call here", SPEC) == ToolAnswer("no call here", [])


def test_streamed_content_never_holds_markup() -> None:
    text = "Sure.\n" + CALL
    for n in range(1, len(text) + 1):
        stream = ToolCallText(SPEC)
        deltas = [stream.update(text[:i], False)[0] for i in range(1, n)]
        last, calls = stream.update(text[:n], True, cut=True)
        assert "".join([*deltas, last]) == stream.sent == "Sure.\n"[:n]
        assert "<" not in stream.sent


DIGIT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "additionalProperties": False,
}
SHORT = [{"type": "function", "function": {"name": "f", "parameters": DIGIT}}]
LONGEST_CALL = smallest_call("f", '{"x": 9}')


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_cut_at_every_max_tokens(engines: dict[str, Engine], choice) -> None:
    """max_tokens 1..64 with `required` / a named function: too few tokens for the smallest call
    is a bad request naming max_tokens; otherwise no markup in the content, and the answer is a
    whole call or, cut, the call as it stands with `finish_reason: length`."""
    eng = engines["llada"]
    encode = eng.tokenizer.encode
    need = len(encode(smallest_call("f"), add_special_tokens=False))
    rids = {}
    for n in range(1, 65):
        params = {"max_tokens": n, "tools": SHORT, "tool_choice": choice, "steps": min(8, n),
                  "block_length": n, "temperature": 1.0, "seed": n}  # fmt: skip
        if n < need:
            with pytest.raises(InvalidRequestError) as err:
                eng.resolve_params(params)
            assert err.value.field == "max_tokens"
            continue
        resolved = eng.resolve_params(params)
        prompt = eng.encode_prompt(messages=MSG, tools=resolved.tools)
        rids[eng.add_request(None, prompt, resolved)] = n
    assert rids  # the smallest call fits in 64 tokens of this tokenizer
    outs = [o for o in eng.outputs() if o.request_id in rids]
    finals = {o.request_id: o for o in outs if o.finished}
    assert set(finals) == set(rids)
    assert not any("<" in o.delta_text or "<" in o.text for o in outs)
    for rid, final in finals.items():
        assert final.text == "" and final.tool_calls, (rids[rid], final)
        call = final.tool_calls[0]["function"]
        assert call["name"] == "f"
        if final.finish_reason == "tool_calls":
            jsonschema.validate(json.loads(call["arguments"]), DIGIT)
        else:
            assert final.finish_reason == "length" and len(final.tool_calls) == 1
            assert '{"x": 9}'.startswith(call["arguments"][:2]), call
        if rids[rid] >= len(encode(LONGEST_CALL, add_special_tokens=False)):
            assert final.finish_reason == "tool_calls", (rids[rid], final)  # room for any call


def test_the_reserve_closes_a_call_before_its_canvas_ends(engines: dict[str, Engine]) -> None:
    """A string the random model never ends, then a required key: the row keeps room for the
    rest of the arguments and the closing markup, so the call comes out whole."""
    schema = {
        "type": "object",
        "properties": {"note": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["note", "unit"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    choice = {"type": "function", "function": {"name": "f"}}
    for n in (96, 112, 128):
        final = _run(engines["llada"], {"max_tokens": n, "tools": tools, "tool_choice": choice})[-1]
        assert final.finish_reason == "tool_calls", (n, final)
        jsonschema.validate(json.loads(final.tool_calls[0]["function"]["arguments"]), schema)


def test_tool_names_and_references_are_checked(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    for name in ("get weather", "a" * 65, "", "f<x>", 'say"hi'):
        tools = [TOOLS[0], {"type": "function", "function": {"name": name}}]
        with pytest.raises(InvalidRequestError) as err:
            eng.resolve_params({"tools": tools})
        assert err.value.field == ("tools" if name == "" else "tools[1].function.name"), name
    with pytest.raises(InvalidRequestError) as err:
        eng.resolve_params({"tools": [*TOOLS, TOOLS[1]]})
    assert err.value.field == f"tools[{len(TOOLS)}].function.name"
    eng.resolve_params(
        {"tools": [{"type": "function", "function": {"name": "A-z_0" * 12 + "abcd"}}]}
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "3"}
    eng.encode_prompt(messages=[*MSG, asked, answer])
    for messages, i in (
        ([*MSG, answer], 1),  # no call made yet
        ([*MSG, answer, asked], 1),  # the call comes after its result
        ([*MSG, asked, {**answer, "tool_call_id": "c2"}], 2),
        ([*MSG, asked, {"role": "tool", "content": "3"}], 2),
    ):
        with pytest.raises(InvalidRequestError) as err:
            eng.encode_prompt(messages=messages)
        assert err.value.field == f"messages[{i}].tool_call_id"


def test_the_proxy_names_the_field() -> None:
    """The same rules at the proxy, before Triton is asked (nothing listens behind this one),
    and chat's `logprobs` is OpenAI's boolean."""
    import socket

    from fastapi.testclient import TestClient

    from openai_proxy.app import create_app
    from openai_proxy.config import ProxyConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    cases = [
        ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "get weather"}}]},
         "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
         "tools[0].function.name"),
        ({"tools": [*TOOLS, TOOLS[0]]}, f"tools[{len(TOOLS)}].function.name"),
        ({"messages": [*MSG, {"role": "tool", "tool_call_id": "c1", "content": "3"}]},
         "messages[1].tool_call_id"),
        ({"messages": [*MSG, asked, {"role": "tool", "tool_call_id": "c9", "content": "3"}]},
         "messages[2].tool_call_id"),
        ({"logprobs": 5}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),
    ]  # fmt: skip
    with TestClient(create_app(ProxyConfig(triton_urls=[dead], health_timeout_s=0.5))) as http:
        for extra, field in cases:
            body = {"model": "m", "messages": MSG, **extra}
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400, (extra, resp.text)
            assert resp.json()["error"]["param"] == field, (extra, resp.json())
        fine = {"messages": [*MSG, asked, {"role": "tool", "tool_call_id": "c1", "content": "3"}],
                "tools": TOOLS, "logprobs": True}  # fmt: skip
        resp = http.post("/v1/chat/completions", json={"model": "m", **fine})
        assert resp.status_code == 503  # valid: on to the (absent) server
        done = {"model": "m", "prompt": "x", "logprobs": 5}
        assert http.post("/v1/completions", json=done).status_code == 503
