"""Shapes of the structure keys, checked with the rest of the contract: each function
returns why a value is malformed, or None. Whether a well-formed schema, regex or grammar
compiles is the engine's check (llguidance), with the same field name in its error."""

from __future__ import annotations

import json
from typing import Any

# JSON nesting of a schema value (`response_format`, `tools`): deeper values are refused before
# anything recursive (repr, json.dumps, llguidance's compiler) reads them
MAX_NESTING = 64
_TOO_DEEP = f"nested more than {MAX_NESTING} levels deep"


def nesting_exceeds(value: Any, limit: int = MAX_NESTING) -> bool:
    """Is `value` (dicts and lists) nested deeper than `limit`? Iterative: any depth is safe."""
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return True
            todo.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def response_format(value: Any) -> str | None:
    """OpenAI's object (or the same as a JSON string); its `type` and `json_schema` are checked
    by the engine, whose errors name the inner field (``response_format.type``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return "must be an object {type: text | json_object | json_schema} or its JSON"
        except RecursionError:
            return _TOO_DEEP
    if not isinstance(value, dict):
        return "must be an object {type: text | json_object | json_schema}"
    if nesting_exceeds(value):
        return _TOO_DEEP
    return None


def non_empty_string(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    return None


def string_list(value: Any) -> str | None:
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        return "must be a non-empty list of strings"
    return None


# ---- tool calling (OpenAI's `tools` and `tool_choice`; the engine checks the rest) ----
TOOL_CHOICES = ("none", "auto", "required")


def json_value(value: Any) -> Any:
    """Triton request parameters carry only scalars: an object or list may come as its JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value
    return value


def tools(value: Any) -> str | None:
    """A list of {type: function, function: {name, description?, parameters?}}."""
    value = json_value(value)
    if not isinstance(value, list):
        return "must be a list of {type: function, function: {name, parameters}}"
    if nesting_exceeds(value):
        return _TOO_DEEP
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            return f"[{i}] must be {{type: function, function: {{name, parameters}}}}"
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"[{i}].function.name must be a non-empty string"
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            return f"[{i}].function.parameters must be a JSON schema object"
    return None


def tool_choice(value: Any) -> str | None:
    """`none`, `auto`, `required`, or {type: function, function: {name}}."""
    value = json_value(value) if isinstance(value, str) and value[:1] == "{" else value
    if isinstance(value, str):
        return None if value in TOOL_CHOICES else _TOOL_CHOICE_REASON
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or value.get("type") != "function":
        return _TOOL_CHOICE_REASON
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        return "function.name must be a non-empty string"
    return None


_TOOL_CHOICE_REASON = "must be one of none, auto, required, or {type: function, function: {name}}"
