"""Tool calls at the edge of `max_tokens`, and the tool rules, through the served stack with the
official `openai` client.

With `tool_choice` `required` or a named function, a `max_tokens` too small for the smallest
call of an allowed function is a 400 naming `max_tokens`; any other answer has no markup
(`<tool_call>`, `{"name": ...`) in its content, streamed or not, and is a whole call, or the
call as it stands with `finish_reason: length`. Triton's own response fields hold to the
same. Function names follow OpenAI's pattern, each once, and a tool result must answer a call
made earlier: 400s naming the field. The stack's model is a tiny random LLaDA with a character tokenizer (one token a
character), so the smallest call of `f` takes 55 tokens.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from dlm_client import DLMClient, DLMError
from reliability_stack import MODEL

from dlm_engine.tools import shortest_json, smallest_call
from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}  # fmt: skip
DIGIT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "f": DIGIT}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": s}}
    for n, s in SCHEMAS.items()
]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# characters = tokens for this model's tokenizer
NEED = {n: len(smallest_call(n, shortest_json(s))) for n, s in SCHEMAS.items()}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _ask(oai: openai.OpenAI, choice, max_tokens: int, stream: bool) -> dict:
    """One call, as what a client saw: status, param, content, calls, finish reason."""
    keys = {"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": choice,
            "max_tokens": max_tokens, "temperature": 1.0, "seed": max_tokens,
            "extra_body": {"steps": min(16, max_tokens), "block_length": max_tokens}}  # fmt: skip
    try:
        if not stream:
            choice0 = oai.chat.completions.create(**keys).choices[0]
            calls = [c.model_dump() for c in choice0.message.tool_calls or ()]
            return {"status": 200, "content": choice0.message.content or "", "calls": calls,
                    "finish": choice0.finish_reason}  # fmt: skip
        content, calls, finish = "", {}, None
        for chunk in oai.chat.completions.create(**keys, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                for tc in c.delta.tool_calls or ():
                    calls[tc.index] = tc.model_dump()
                finish = c.finish_reason or finish
        ordered = [calls[i] for i in sorted(calls)]
        return {"status": 200, "content": content, "calls": ordered, "finish": finish}
    except openai.BadRequestError as err:
        return {"status": 400, "param": err.body["param"], "message": err.body["message"]}


def _check(outcome: dict, allowed: set[str], max_tokens: int) -> None:
    need = min(NEED[n] for n in allowed)
    if max_tokens < need:
        assert outcome["status"] == 400 and outcome["param"] == "max_tokens", outcome
        assert "cannot hold" in outcome["message"]
        return
    assert outcome["status"] == 200, outcome
    assert "<" not in outcome["content"], outcome  # no markup, streamed or not
    assert outcome["calls"], outcome
    for call in outcome["calls"]:
        fn = call["function"]
        assert fn["name"] in allowed and call["id"].startswith("call_"), outcome
    if outcome["finish"] == "length":  # cut: the last call as it stands
        last = outcome["calls"][-1]["function"]["arguments"]
        assert last == "" or last.startswith("{"), outcome
        whole = outcome["calls"][:-1]
    else:
        assert outcome["finish"] == "tool_calls", outcome
        whole = outcome["calls"]
    for call in whole:
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def test_cut_calls_never_leak_markup(stack: TritonServerProcess) -> None:
    oai = openai.OpenAI(base_url=stack.urls["openai"], api_key="none", max_retries=0,
                        timeout=300)  # fmt: skip
    cases = [
        (choice, allowed, n, i % 2 == 1)
        for choice, allowed, sizes in (
            ("required", set(SCHEMAS), [*range(4, 41, 4), 54, 55, 56, 60, 64, 72, 96]),
            (_named("f"), {"f"}, [4, 16, 40, 54, 55, 58, 62, 128]),
            (_named("get_weather"), {"get_weather"}, [40, 93, 94, 96, 100, 128]),
        )
        for i, n in enumerate(sizes)
    ]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda c: _ask(oai, c[0], c[2], c[3]), cases))
    served = cut = 0
    for (choice, allowed, n, _), outcome in zip(cases, outcomes, strict=True):
        _check(outcome, allowed, n)
        served += outcome["status"] == 200
        cut += outcome.get("finish") == "length"
        if n == 128:  # room for the longest call: always whole
            assert outcome["finish"] == "tool_calls", (choice, outcome)
    print(f"\n{len(cases)} calls: {served} answered ({cut} cut, as length), "
          f"{len(cases) - served} refused naming max_tokens")  # fmt: skip
    assert served >= 10


def test_triton_fields_hold_no_markup_either(stack: TritonServerProcess) -> None:
    client = DLMClient(stack.urls["grpc"], stack.model_name, http_url=stack.urls["http"])
    for max_tokens in (56, 60, 64):
        keys = {"messages": MSG, "tools": TOOLS, "tool_choice": _named("f"),
                "max_tokens": max_tokens, "temperature": 1.0, "seed": max_tokens}  # fmt: skip
        for out in (client.generate(**keys), client.generate(**keys, stream=True),
                    client.generate_http(**keys)):  # fmt: skip
            assert "<" not in out.text, out
            assert out.tool_calls and out.tool_calls[0]["function"]["name"] == "f", out
            assert out.finish_reason in ("tool_calls", "length"), out
    with pytest.raises(DLMError) as err:
        client.generate(messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=16)
    assert "invalid request: max_tokens" in str(err.value)


def test_tool_names_and_references_are_400s(stack: TritonServerProcess) -> None:
    oai = openai.OpenAI(base_url=stack.urls["openai"], api_key="none", max_retries=0)
    client = DLMClient(stack.urls["grpc"], stack.model_name, http_url=stack.urls["http"])
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    cases = [
        ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "get weather"}}]},
         "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
         "tools[0].function.name"),
        ({"tools": [TOOLS[1], {"type": "function", "function": {"name": "<tool_call>"}}]},
         "tools[1].function.name"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name"),
        ({"messages": [*MSG, {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]},
         "messages[1].tool_call_id"),
        ({"messages": [*MSG, asked, {"role": "tool", "tool_call_id": "call_2", "content": "x"}]},
         "messages[2].tool_call_id"),
    ]  # fmt: skip
    for extra, field in cases:
        keys = {"messages": MSG, "max_tokens": 8, **extra}
        with pytest.raises(openai.BadRequestError) as bad:
            oai.chat.completions.create(model=MODEL, **keys)
        assert bad.value.body["param"] == field, (extra, bad.value.body)
        with pytest.raises(DLMError) as err:  # Triton: the same rule, the same field
            client.generate(**keys)
        assert f"invalid request: {field}" in str(err.value), str(err.value)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, logprobs=5)  # type: ignore[arg-type]
    assert bad.value.body["param"] == "logprobs"
    # the answered call, sent back with its result, is accepted
    history = [*MSG, asked, {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
