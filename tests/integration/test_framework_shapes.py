"""The request bodies LangChain, LlamaIndex and the OpenAI Agents SDK send, against the real
proxy and tritonserver, without installing those frameworks.

Each body is written out as the library builds it (field for field, in its order):
- LangChain `ChatOpenAI` (langchain-openai `BaseChatOpenAI._default_params` +
  `_get_request_payload`): `model`, `stream`, the non-null settings (`max_tokens`, `n`,
  `temperature`, ...), `stream_options: {include_usage: true}` when streaming (`stream_usage`),
  `bind_tools` tools and `tool_choice` (`"any"` becomes `"required"`), `with_structured_output`'s
  `response_format` json_schema with `strict`, an `AIMessage` with tool calls as content null;
  `model_kwargs` / invoke kwargs (e.g. `metadata`, `store`) merged into the body.
- LlamaIndex `OpenAI` / `OpenAILike` (`_get_model_kwargs`): `messages`, `stream`, `model`,
  `temperature` (0.1 by default), `max_tokens` when set; `complete` on a non-chat model goes to
  /v1/completions with the same keys; tools from `FunctionTool.metadata.to_openai_tool()` with
  `tool_choice: "auto"`.
- OpenAI Agents SDK `OpenAIChatCompletionsModel._fetch_response`: `model`, `messages` (the
  agent's instructions as a system message first), `tools` with `strict: true` schemas
  (`additionalProperties: false`), `parallel_tool_calls`, `stream`, `stream_options`, `store`,
  `metadata`, `temperature`, `top_p`, `max_tokens` from `ModelSettings` (unset ones left out),
  an assistant turn with tool calls and no content key, the tool result as a `tool` message.
The session model has random weights: the tests check that each shape is accepted and answered
in OpenAI's response shape (and, with `tool_choice` required, with valid tool calls), not text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import proxy_fixtures
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration

proxy = proxy_fixtures.proxy
model = proxy_fixtures.model

SYSTEM = {"content": "You are a helpful assistant.", "role": "system"}
USER = {"content": "What is 3 times 4?", "role": "user"}

# langchain_core.utils.function_calling.convert_to_openai_tool(multiply)
LC_TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "type": "object",
        },
    },
}
# agents.function_tool(multiply): a strict schema, as FunctionTool.strict_json_schema defaults
AGENTS_TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "properties": {
                "a": {"title": "A", "type": "integer"},
                "b": {"title": "B", "type": "integer"},
            },
            "required": ["a", "b"],
            "title": "multiply_args",
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
# llama_index FunctionTool.from_defaults(multiply).metadata.to_openai_tool()
LLAMA_TOOL = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "multiply(a: int, b: int) -> int\nMultiply two integers.",
        "parameters": {
            "properties": {
                "a": {"title": "A", "type": "integer"},
                "b": {"title": "B", "type": "integer"},
            },
            "required": ["a", "b"],
            "type": "object",
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "multiply", "arguments": '{"a": 3, "b": 4}'},
}
ANSWER_SCHEMA = {
    "properties": {"answer": {"description": "The product.", "type": "integer"}},
    "required": ["answer"],
    "title": "Answer",
    "type": "object",
    "additionalProperties": False,
}

# name -> (body without `model`, what the answer must hold: "text" | "tool_calls")
CHAT_BODIES: dict[str, tuple[dict[str, Any], str]] = {
    "langchain-invoke": (
        {"messages": [SYSTEM, USER], "stream": False, "max_tokens": 16, "n": 1},
        "text",
    ),
    "langchain-invoke-model-kwargs": (
        {
            "messages": [USER],
            "stream": False,
            "max_tokens": 16,
            "temperature": 0.7,
            "seed": 7,
            "metadata": {"ls_run": "abc", "user_tier": "free"},
            "store": False,
            "user": "alice",
        },
        "text",
    ),
    "langchain-bind-tools-any": (
        {
            "messages": [USER],
            "stream": False,
            "max_tokens": 128,
            "tools": [LC_TOOL],
            "tool_choice": "required",
        },
        "tool_calls",
    ),
    "langchain-structured-function-calling": (
        {
            "messages": [USER],
            "stream": False,
            "max_tokens": 128,
            "tools": [LC_TOOL],
            "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "multiply"}},
        },
        "tool_calls",
    ),
    "langchain-structured-json-schema": (
        {
            "messages": [USER],
            "stream": False,
            "max_tokens": 48,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "Answer",
                    "description": "The answer.",
                    "schema": ANSWER_SCHEMA,
                    "strict": True,
                },
            },
        },
        "json",
    ),
    "langchain-tool-result": (
        {
            "messages": [
                USER,
                {"content": None, "role": "assistant", "tool_calls": [CALL]},
                {"content": "12", "role": "tool", "tool_call_id": "call_1"},
            ],
            "stream": False,
            "max_tokens": 16,
            "tools": [LC_TOOL],
        },
        "text",
    ),
    "llamaindex-chat": (
        # LlamaIndex `OpenAI(temperature=0.1)` sends no max_tokens: the model's default applies
        {"messages": [SYSTEM, USER], "stream": False, "temperature": 0.1},
        "text",
    ),
    "llamaindex-chat-max-tokens-logprobs": (
        {
            "messages": [USER],
            "stream": False,
            "temperature": 0.1,
            "max_tokens": 16,
            "logprobs": True,
            "top_logprobs": 2,
        },
        "text",
    ),
    "llamaindex-tools": (
        {
            "messages": [USER],
            "stream": False,
            "temperature": 0.1,
            "max_tokens": 128,
            "tools": [LLAMA_TOOL],
            "tool_choice": "auto",
        },
        "text_or_tool_calls",
    ),
    "agents-sdk": (
        {"messages": [SYSTEM, USER], "tools": [AGENTS_TOOL], "stream": False},
        "text_or_tool_calls",
    ),
    "agents-sdk-model-settings": (
        {
            "messages": [SYSTEM, USER],
            "tools": [AGENTS_TOOL],
            "temperature": 0.2,
            "top_p": 0.9,
            "max_tokens": 128,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "stream": False,
            "store": True,
            "metadata": {"workflow": "math", "trace_id": "trace_123"},
        },
        "tool_calls",
    ),
    "agents-sdk-tool-result": (
        {
            "messages": [
                SYSTEM,
                USER,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12"},
            ],
            "tools": [AGENTS_TOOL],
            "stream": False,
            "max_tokens": 16,
        },
        "text_or_tool_calls",
    ),
}

STREAM_BODIES: dict[str, dict[str, Any]] = {
    "langchain-stream": {
        "messages": [SYSTEM, USER],
        "stream": True,
        "max_tokens": 16,
        "stream_options": {"include_usage": True},
    },
    "llamaindex-stream": {"messages": [USER], "stream": True, "temperature": 0.1, "max_tokens": 16},
    "agents-sdk-stream": {
        "messages": [SYSTEM, USER],
        "tools": [AGENTS_TOOL],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "metadata": {"workflow": "math"},
    },
}
COMPLETION_BODIES: dict[str, dict[str, Any]] = {
    # LlamaIndex OpenAILike(is_chat_model=False).complete(): max_tokens from its context window
    "llamaindex-complete": {
        "prompt": "3 times 4 is",
        "stream": False,
        "temperature": 0.1,
        "max_tokens": 16,
    },
}


def _post(proxy: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(proxy.base_url + path, json=body, timeout=300)


@pytest.mark.parametrize("name", list(CHAT_BODIES))
def test_chat_bodies_are_answered_in_openais_shape(proxy: Any, model: str, name: str) -> None:
    body, expect = CHAT_BODIES[name]
    r = _post(proxy, "/v1/chat/completions", {"model": model, **body})
    assert r.status_code == 200, (name, r.text)
    done = ChatCompletion.model_validate(r.json())  # the openai client's own response type
    choice = done.choices[0]
    assert done.model == model and done.usage is not None and done.usage.completion_tokens > 0
    calls = choice.message.tool_calls or []
    if expect == "tool_calls":
        assert calls and choice.finish_reason == "tool_calls"
        for call in calls:
            assert call.function.name == "multiply"
            args = json.loads(call.function.arguments)
            assert isinstance(args["a"], int) and isinstance(args["b"], int)
        if body.get("parallel_tool_calls") is False:
            assert len(calls) == 1
    elif expect == "json":
        assert isinstance(json.loads(choice.message.content or "")["answer"], int)
    elif expect == "text":
        assert not calls and isinstance(choice.message.content, str)
    else:  # the model may answer or call: either way a well-formed answer
        assert calls or isinstance(choice.message.content, str)
    if body.get("logprobs"):
        assert choice.logprobs is not None and choice.logprobs.content


@pytest.mark.parametrize("name", list(STREAM_BODIES))
def test_streamed_bodies_give_openai_chunks(proxy: Any, model: str, name: str) -> None:
    body = {"model": model, **STREAM_BODIES[name]}
    with httpx.stream("POST", proxy.base_url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e)) for e in events[:-1]]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length", "tool_calls")
    usage = [c.usage for c in chunks if c.usage is not None]
    if body.get("stream_options", {}).get("include_usage"):
        assert usage and not chunks[-1].choices and usage[-1].completion_tokens > 0
    else:
        assert not usage


@pytest.mark.parametrize("name", list(COMPLETION_BODIES))
def test_completion_bodies(proxy: Any, model: str, name: str) -> None:
    r = _post(proxy, "/v1/completions", {"model": model, **COMPLETION_BODIES[name]})
    assert r.status_code == 200, r.text
    done = Completion.model_validate(r.json())
    assert isinstance(done.choices[0].text, str) and done.usage.completion_tokens > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("metadata", {f"k{i}": "v" for i in range(17)}),
        ("metadata", {"k": "v" * 513}),
        ("metadata", {"k": 1}),
        ("store", "yes"),
        ("service_tier", "gold"),
        ("reasoning_effort", "low"),
    ],
)
def test_framework_fields_outside_openais_shape_are_400s(
    proxy: Any, model: str, field: str, value: Any
) -> None:
    body = {"model": model, "messages": [USER], "max_tokens": 4, field: value}
    r = _post(proxy, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_logit_bias_through_the_proxy_and_triton(
    proxy: Any, model: str, client: Any, tiny_checkpoint: Path
) -> None:
    """+100 forces a token at every position, -100 bans it, on every surface."""
    (q,) = AutoTokenizer.from_pretrained(str(tiny_checkpoint)).encode("q", add_special_tokens=False)
    forced = {"logit_bias": {str(q): 100}, "max_tokens": 8, "steps": 8}
    body = {"model": model, "messages": [USER], **forced}
    r = _post(proxy, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "q" * 8
    text = _post(proxy, "/v1/completions", {"model": model, "prompt": "3 times 4 is", **forced})
    assert text.status_code == 200 and text.json()["choices"][0]["text"] == "q" * 8, text.text
    assert client.generate(messages=[USER], **forced).text == "q" * 8  # Triton gRPC
    assert client.generate_http(messages=[USER], **forced).text == "q" * 8  # Triton HTTP
    banned = {"logit_bias": {str(q): -100}, "max_tokens": 8, "steps": 8}
    both = {"logit_bias": {str(q): 100}, "max_tokens": 8, "steps": 8, "temperature": 1.0}
    assert "q" not in client.generate(messages=[USER], **banned, temperature=1.5, seed=1).text
    assert client.generate(messages=[USER], **both, seed=2).text == "q" * 8
    bad = _post(proxy, "/v1/chat/completions", {**body, "logit_bias": {"99999999": 5}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
