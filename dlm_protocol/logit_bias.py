"""OpenAI's `logit_bias`: a map of token id -> bias in [-100, 100], checked from the value alone.

Token ids come as JSON object keys, so they are strings on the wire ("50256"); a Python caller
may pass integers. Both forms mean the same id, and one id given twice with different biases is
refused. Whether an id exists is the model's check (the engine knows its vocabulary).
"""

from __future__ import annotations

import math
from typing import Any

from .structure_shapes import json_value

MAX_BIAS = 100.0
# Entries per request at most: enough to ban or favour any word list a client builds, small
# enough that the per-step scatter stays a few kilobytes.
MAX_ENTRIES = 1024


def _token_id(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    return None


def _bias(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or not -MAX_BIAS <= value <= MAX_BIAS:
        return None
    return float(value)


def parse(value: Any) -> tuple[dict[int, float], str | None]:
    """({token id: bias}, None), or ({}, why the value is malformed)."""
    value = json_value(value)  # Triton request parameters carry an object as its JSON
    if not isinstance(value, dict):
        return {}, "must be an object mapping token ids to biases in [-100, 100]"
    if len(value) > MAX_ENTRIES:
        return {}, f"at most {MAX_ENTRIES} tokens"
    out: dict[int, float] = {}
    for key, raw in value.items():
        token = _token_id(key)
        if token is None:
            return {}, f"key {key!r} is not a token id (an integer >= 0)"
        bias = _bias(raw)
        if bias is None:
            return {}, f"bias of token {token} must be a number in [-100, 100], got {raw!r}"
        if out.get(token, bias) != bias:
            return {}, f"token {token} is given twice with different biases"
        out[token] = bias
    return out, None


def shape(value: Any) -> str | None:
    """Why `value` is not a valid logit_bias, or None."""
    return parse(value)[1]


def token_biases(value: Any) -> dict[int, float]:
    """The {token id: bias} of a value `shape` accepted ({} for None); non-zero biases only."""
    if value is None:
        return {}
    biases, reason = parse(value)
    if reason:
        raise ValueError(reason)
    return {t: b for t, b in biases.items() if b != 0.0}
