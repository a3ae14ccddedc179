"""Shapes of the structure keys (issue 17), checked with the rest of the contract: each function
returns why a value is malformed, or None. Whether a well-formed schema, regex or grammar
compiles is the engine's check (llguidance), with the same field name in its error."""

from __future__ import annotations

import json
from typing import Any


def response_format(value: Any) -> str | None:
    """OpenAI's object (or the same as a JSON string); its `type` and `json_schema` are checked
    by the engine, whose errors name the inner field (``response_format.type``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return "must be an object {type: text | json_object | json_schema} or its JSON"
    if not isinstance(value, dict):
        return "must be an object {type: text | json_object | json_schema}"
    return None


def non_empty_string(value: Any) -> str | None:
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    return None


def string_list(value: Any) -> str | None:
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        return "must be a non-empty list of strings"
    return None
