"""The rules across a request's tools and its messages that OpenAI enforces, checked the same way
on every surface (the proxy's schemas, the engine behind Triton): function names OpenAI
accepts, each named once, and every tool result answering a call made earlier."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import InvalidRequestError

# OpenAI's rule for a function name: clients and the chat templates rely on it (no quotes,
# spaces or markup that could end a call's JSON or the template's tags early)
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def check_tool_names(tools: Iterable[Mapping[str, Any]]) -> None:
    """Each `tools[i].function.name` matches OpenAI's pattern and no name is given twice."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        field = f"tools[{i}].function.name"
        if not isinstance(name, str) or TOOL_NAME.fullmatch(name) is None:
            raise InvalidRequestError(
                field, f"{str(name)[:80]!r} must be 1 to 64 letters, digits, '_' or '-'"
            )
        if name in seen:
            raise InvalidRequestError(field, f"function {name!r} is given twice")
        seen.add(name)


def check_tool_call_ids(messages: Iterable[Mapping[str, Any]]) -> None:
    """Every `tool` message names, in `tool_call_id`, a call of an earlier assistant message."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            for call in m.get("tool_calls") or ():
                if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                    ids.add(call["id"])
        elif m.get("role") == "tool":
            ref = m.get("tool_call_id")
            field = f"messages[{i}].tool_call_id"
            if not isinstance(ref, str) or not ref:
                raise InvalidRequestError(field, "a tool message names the call it answers")
            if ref not in ids:
                raise InvalidRequestError(
                    field,
                    f"{ref[:80]!r} is the id of no tool call in an earlier assistant message",
                )
