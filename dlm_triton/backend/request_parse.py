"""Turn one Triton request's tensors and parameters into a prompt + sampling dict.

Triton 2.51 does not reject requests missing inputs when all inputs are optional, and gRPC
streams drop error codes, so every problem becomes a :class:`RequestError` whose message
starts with ``invalid request: `` (the proxy maps that prefix to HTTP 400).
No Triton import: it is fed numpy arrays and the ``request.parameters()`` JSON string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dlm_protocol.errors import PREFIX_INVALID
from dlm_protocol.tensors import PROMPT_INPUT_NAMES as PROMPT_INPUTS
from dlm_protocol.tensors import SAMPLING_PARAMETERS, STREAM

# Request parameters Triton or tritonclient add themselves; never sampling keys. `priority` is
# the contract's key: gRPC and HTTP `infer` keep a `priority` request parameter for Triton's own
# scheduler (it never gets here), so one that does get here (HTTP `generate`) is ours.
_RESERVED_PREFIXES = ("triton_", "sequence_", "timeout", "binary_data")


class RequestError(ValueError):
    """A bad request; ``str()`` is the message sent to the client."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{PREFIX_INVALID} {message}")


@dataclass
class ParsedRequest:
    prompt_kind: str  # one of PROMPT_INPUTS
    prompt: Any  # str | list[dict] | list[int]
    stream: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)


def _single(name: str, array: np.ndarray) -> Any:
    """The one element of a ``[1]`` / ``[1, 1]`` tensor (batch size must be 1)."""
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{name}: expected one element, got shape {list(np.shape(array))}")
    return flat[0]


def _text(name: str, array: np.ndarray) -> str:
    value = _single(name, array)
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{name}: not valid UTF-8") from exc
    if isinstance(value, str):
        return value
    raise RequestError(f"{name}: expected a string (BYTES tensor)")


def _json(name: str, raw: str) -> Any:
    """Parsed JSON; nesting deep enough to exhaust the parser's recursion is a bad request."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{name}: not valid JSON ({exc.msg})") from exc
    except RecursionError:
        raise RequestError(f"{name}: JSON nested too deeply") from None


def _messages(array: np.ndarray) -> list[dict[str, str]]:
    messages = _json("messages", _text("messages", array))
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty JSON list of {role, content}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RequestError(f"messages[{i}]: expected an object with a string 'role'")
        # an assistant message that calls tools may have no content
        if not isinstance(msg.get("content"), str) and not (
            msg.get("content") is None and msg.get("tool_calls")
        ):
            raise RequestError(f"messages[{i}].content: expected a string")
    return messages


def _input_ids(array: np.ndarray) -> list[int]:
    arr = np.asarray(array)
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            raise RequestError(f"input_ids: batch size must be 1, got shape {list(arr.shape)}")
        arr = arr[0]
    if arr.ndim != 1 or arr.size == 0:
        raise RequestError("input_ids: expected a non-empty list of token ids")
    if not np.issubdtype(arr.dtype, np.integer):
        raise RequestError("input_ids: expected integers")
    if (arr < 0).any():
        raise RequestError("input_ids: token ids must be >= 0")
    return [int(x) for x in arr]


def _stream(array: np.ndarray) -> bool:
    value = _single("stream", array)
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise RequestError("stream: expected a BOOL tensor")


def parse_parameters(raw: str | None) -> dict[str, Any]:
    """``request.parameters()`` JSON, minus keys Triton/tritonclient reserve."""
    if not raw:
        return {}
    params = _json("parameters", raw)
    if not isinstance(params, dict):
        raise RequestError("parameters: expected an object")
    return {k: v for k, v in params.items() if not k.startswith(_RESERVED_PREFIXES)}


def parse_request(inputs: dict[str, np.ndarray], parameters: str | None) -> ParsedRequest:
    """Validate one request. ``inputs`` maps present input names to their numpy arrays."""
    given = [name for name in PROMPT_INPUTS if name in inputs]
    if len(given) != 1:
        found = ", ".join(given) or "none"
        raise RequestError(f"exactly one of {', '.join(PROMPT_INPUTS)} is required (got {found})")
    kind = given[0]
    if kind == "text_input":
        prompt: Any = _text("text_input", inputs[kind])
        if not prompt:
            raise RequestError("text_input: empty prompt")
    elif kind == "messages":
        prompt = _messages(inputs[kind])
    else:
        prompt = _input_ids(inputs[kind])

    sampling = parse_parameters(parameters)
    stream = False
    if "stream" in sampling:  # HTTP generate may pass it as a parameter
        value = sampling.pop("stream")
        if not isinstance(value, bool):
            raise RequestError("stream: expected true or false")
        stream = value
    if STREAM.name in inputs:
        stream = _stream(inputs[STREAM.name])
    if SAMPLING_PARAMETERS.name in inputs:
        raw = _text(SAMPLING_PARAMETERS.name, inputs[SAMPLING_PARAMETERS.name])
        if raw.strip():
            tensor_params = _json("sampling_parameters", raw)
            if not isinstance(tensor_params, dict):
                raise RequestError("sampling_parameters: expected a JSON object")
            sampling.update(tensor_params)  # the tensor wins on conflict
    return ParsedRequest(kind, prompt, stream, sampling)
