"""DiffusionGemma's tool calls in Gemma 4's own syntax (dlm_engine/tool_gemma4.py):

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>c<|"|>}<tool_call|>

The family names its format (`Family.tool_format`); the chat template renders the tools, earlier
calls and their results; `required` / a named function constrain the canvas into that syntax
so every answer's calls parse and validate with random weights; the text is parsed back into
OpenAI's `tool_calls` with no markup ever in the content, streamed or cut by `max_tokens`.
The tiny checkpoint has Gemma 4's layout: its markup is special tokens, as the published one's.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from dlm_engine import Engine, EngineConfig, InvalidRequestError
from dlm_engine.tool_gemma4 import Gemma4Format, json_prefix
from dlm_engine.tools import HERMES, ToolCallText, ToolSpec, parse_tool_calls
from dlm_lab.testing_diffusion_gemma import WEATHER_SCHEMA, make_tiny_diffusion_gemma

pytest.importorskip("transformers")

Q = '<|"|>'
SCHEMAS = {
    "get_weather": WEATHER_SCHEMA,
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
                    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6}},
                    "required": ["name"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            },
            "vip": {"type": "boolean"},
            "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
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
MSG = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    ckpt = make_tiny_diffusion_gemma(tmp_path_factory.mktemp("g4") / "g4", chat="gemma4")
    return Engine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_rows=16))


@pytest.fixture(scope="module")
def plain_template(tmp_path_factory) -> Engine:
    """Gemma's older turn template, which knows no tools, and no markup tokens."""
    ckpt = make_tiny_diffusion_gemma(tmp_path_factory.mktemp("g3") / "g3")
    return Engine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_rows=4))


def _run(eng: Engine, params: dict, messages=MSG) -> list:
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


def test_the_family_names_its_format(engine, plain_template, engines) -> None:
    from dlm_engine.models import DIFFUSION_GEMMA, DREAM, LLADA

    assert DIFFUSION_GEMMA.tool_format == "gemma4"
    assert LLADA.tool_format == DREAM.tool_format == "hermes"
    assert isinstance(engine.tool_format, Gemma4Format)
    assert set(engine.tool_format.special) >= {"<|tool_call>", "<tool_call|>", Q}
    assert isinstance(plain_template.tool_format, Gemma4Format)
    assert plain_template.tool_format.special == {}  # its tokenizer has no such tokens
    assert engines["llada"].tool_format is HERMES
    spec = engine.resolve_params({"tools": TOOLS}).tools
    assert spec.format is engine.tool_format


def test_the_template_renders_tools_calls_and_results(engine) -> None:
    resolved = engine.resolve_params({"tools": TOOLS[:1]})
    messages = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"unit": "c", "city": "Paris"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    ]
    ids = engine.encode_prompt(messages=messages, tools=resolved.tools)
    text = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|tool>declaration:get_weather{description:" in text
    assert f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}c{Q}}}<tool_call|>" in text
    assert f"<|tool_response>response:get_weather{{value:{Q}20C{Q}}}<tool_response|>" in text
    assert engine.tokenizer.convert_tokens_to_ids("<|tool_call>") in ids  # one special token


def test_a_template_without_tools_gets_gemma4_text(plain_template) -> None:
    eng = plain_template
    resolved = eng.resolve_params({"tools": TOOLS[:1]})
    messages = [
        *MSG,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c9",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c9", "content": "30F"},
    ]
    text = eng.tokenizer.decode(eng.encode_prompt(messages=messages, tools=resolved.tools))
    assert "<|tool>declaration:get_weather" in text and "<|tool_call>call:NAME" in text
    assert f"<|tool_call>call:get_weather{{city:{Q}Rome{Q},unit:{Q}f{Q}}}<tool_call|>" in text
    assert f"<|tool_response>response:get_weather{{value:{Q}30F{Q}}}" in text


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_named_function_calls_always_validate(engine: Engine, name: str) -> None:
    choice = {"type": "function", "function": {"name": name}}
    for seed in (0, 1, 2):
        outs = _run(
            engine, {"tools": TOOLS, "tool_choice": choice, "max_tokens": 128, "seed": seed}
        )
        final = outs[-1]
        assert final.error is None and final.finish_reason == "tool_calls", final
        assert final.text == "" and not any("<" in o.delta_text for o in outs)
        assert len(final.tool_calls) == 1
        _validate(final.tool_calls, {name})


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate(engine: Engine, parallel: bool) -> None:
    keys = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel}
    resolved = [engine.resolve_params(keys | {"max_tokens": 160, "seed": s}) for s in range(4)]
    prompt = engine.encode_prompt(messages=MSG, tools=resolved[0].tools)
    outs = engine.generate([prompt] * 4, resolved)
    for out in outs:
        assert out.finish_reason == "tool_calls" and out.text == "", out
        _validate(out.tool_calls, set(SCHEMAS))
        if not parallel:
            assert len(out.tool_calls) == 1


def test_schemas_the_syntax_cannot_enforce_are_refused(engine: Engine) -> None:
    for bad in (
        {"type": "object", "properties": {"x": {"type": "string", "pattern": "^a+$"}}},
        {"type": "object", "properties": {"x": {"type": "string", "format": "date"}}},
        {"type": "object", "properties": {"two words": {"type": "integer"}}},
        {"type": "object", "properties": {"x": {"enum": ["<|tool_call>"]}}},
    ):
        tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
        with pytest.raises(InvalidRequestError) as err:
            engine.resolve_params({"tools": tools, "tool_choice": "required"})
        assert err.value.field == "tools"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert engine.resolve_params({"tools": tools, "tool_choice": "auto"}).tools is not None


def test_max_tokens_must_hold_the_smallest_call(engine: Engine) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    keys = {"tools": TOOLS, "tool_choice": choice}
    smallest = Gemma4Format().call("get_weather", f"{{city:{Q}{Q},unit:{Q}c{Q}}}")
    need = len(engine.tokenizer.encode(smallest, add_special_tokens=False))
    with pytest.raises(InvalidRequestError) as err:
        engine.resolve_params(keys | {"max_tokens": need - 1})
    assert err.value.field == "max_tokens"
    final = _run(engine, keys | {"max_tokens": need, "seed": 3})[-1]
    assert final.finish_reason == "tool_calls", final  # the reserve closes it in time
    _validate(final.tool_calls, {"get_weather"})


# ---- reading the text ------------------------------------------------------------------------

SPEC = ToolSpec(tuple(TOOLS), "auto", format=Gemma4Format())
FMT = SPEC.format


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "null"] + (["obj", "list"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice("ab c,{}[]:\"'\\<>|\n") for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-1000, 1000)
    if kind == "float":
        return rng.choice([1.5, -0.25, 3e-05])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        f"k{i}_{rng.randint(0, 9)}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))
    }


def test_calls_round_trip_through_the_syntax() -> None:
    """Arguments written as the template writes them parse back to the same values, strings
    holding braces, commas, colons, quotes and newlines included."""
    rng = random.Random(0)
    for _ in range(300):
        args = {f"a{i}": _random_value(rng) for i in range(rng.randint(0, 4))}
        args = {k: v for k, v in args.items() if not (isinstance(v, str) and "<|" in v)}
        text = "Sure. " + FMT.call_text("noop", args) + FMT.call_text("add", {"a": 1, "b": 2})
        answer = parse_tool_calls(text, SPEC)
        assert answer.content == "Sure. " and answer.markup
        assert [c["function"]["name"] for c in answer.calls] == ["noop", "add"]
        assert json.loads(answer.calls[0]["function"]["arguments"]) == args


def test_numbers_stay_as_written_and_bad_calls_are_dropped() -> None:
    text = "<|tool_call>call:add{a:1,b:1e999}<tool_call|>"
    assert parse_tool_calls(text, SPEC).calls[0]["function"]["arguments"] == '{"a": 1, "b": 1e999}'
    bad = [
        "<|tool_call>call:nope{a:1}<tool_call|>",  # unknown function
        "<|tool_call>add{a:1}<tool_call|>",  # no call:
        "<|tool_call>call:add{a 1}<tool_call|>",  # no colon
        "<|tool_call>call:add{a:1]<tool_call|>",  # wrong bracket
    ]
    for b in bad:
        answer = parse_tool_calls("Hi " + b, SPEC)
        assert answer.content == "Hi " and answer.calls == [], b
    good = "<|tool_call>call:add{a:1,b:2}<tool_call|>"
    assert len(parse_tool_calls("".join(bad) + good, SPEC).calls) == 1
    assert parse_tool_calls("no call here", SPEC).calls == []


CALL = f"<|tool_call>call:get_weather{{city:{Q}Pa{{r}}is{Q},unit:{Q}c{Q}}}<tool_call|>"
ARGS = {"city": "Pa{r}is", "unit": "c"}


def test_a_call_cut_anywhere_never_leaves_markup_in_content() -> None:
    text = "Sure.\n" + CALL + CALL
    args_end = len("Sure.\n" + CALL) - len("<tool_call|>")
    named = ToolSpec(tuple(TOOLS), "function", "get_weather", format=FMT)
    for spec in (SPEC, named):
        for n in range(len(text) + 1):
            prefix = text[:n]
            answer = parse_tool_calls(prefix, spec, cut=True)
            assert "<" not in answer.content and answer.content == "Sure.\n"[:n]
            whole = parse_tool_calls(prefix, spec)
            assert all(json.loads(c["function"]["arguments"]) == ARGS for c in whole.calls)
            if not answer.calls:
                continue
            first = answer.calls[0]["function"]
            assert first["name"] == "get_weather"
            if n >= args_end:  # the arguments are whole: so is the call
                assert json.loads(first["arguments"]) == ARGS
            else:  # cut: the arguments so far, as the JSON text they begin
                assert answer.cut and len(answer.calls) == 1
                assert '{"city": "Pa{r}is", "unit": "c"}'.startswith(first["arguments"]), first
        assert parse_tool_calls("Sure.\n<|tool_call>call:get_w", spec, cut=True).calls
    two = ToolSpec(tuple(TOOLS), "required", format=FMT)
    assert parse_tool_calls("<|tool_call>call:", two, cut=True).calls == []  # which one?
    assert json_prefix(f"{{a:{Q}x,y") == '{"a": "x,y'


def test_streamed_content_stops_before_the_markup() -> None:
    text = "Sure.\n" + CALL
    for n in range(1, len(text) + 1):
        stream = ToolCallText(SPEC)
        deltas = [stream.update(text[:i], False)[0] for i in range(1, n)]
        last, calls = stream.update(text[:n], True, cut=True)
        assert "".join([*deltas, last]) == stream.sent == "Sure.\n"[:n]
        assert "<" not in stream.sent
    stream = ToolCallText(ToolSpec(tuple(TOOLS), "auto"))  # Hermes holds back its own tag
    assert stream.update("Hi <tool_c", False)[0] == "Hi "
    # markup kept for the parser (special tokens) written outside a call is not content
    kept = ToolSpec(tuple(TOOLS), "auto", format=Gemma4Format({Q: 13, "<tool_call|>": 10}))
    stream = ToolCallText(kept)
    assert stream.update(f"A{Q}B<tool_call|>C", False)[0] == "ABC"
    assert stream.update(f"A{Q}B<tool_call|>CD{Q}", True)[0] == "D"
    assert stream.sent == "ABCD"


def test_auto_answers_stream_no_markup(engine: Engine) -> None:
    """Free answers with tools offered: whatever the random model writes, no markup (special
    tokens included) reaches the content, streamed or final."""
    for seed in range(4):
        outs = _run(engine, {"tools": TOOLS, "max_tokens": 48, "seed": seed})
        final = outs[-1]
        assert final.finished and "<|" not in final.text
        assert "".join(o.delta_text for o in outs) == final.text
