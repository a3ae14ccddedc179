"""Tool calls (issue 17): OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` for a
diffusion model.

* The tool list reaches the model through the checkpoint's chat template
  (`apply_chat_template(tools=...)`) when the template knows tools (Dream's, Qwen2.5's); a
  template without tools (LLaDA's) gets the same instructions as a system message. Tool results
  (`role: tool`) and earlier assistant calls go back through the template, or, for a template
  without tools, as `<tool_response>` / `<tool_call>` text in user / assistant turns.
* The call format is the one those templates teach (Hermes / Qwen2.5):
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, several separated by a
  newline.
* `required` and a named function constrain the output with the structured-output machinery
  (`decoding/constraints.py`): an llguidance Lark grammar of such calls whose arguments are
  `%json` with the function's `parameters` schema, so every finished answer's arguments parse
  and validate. `auto` leaves the model free and parses calls from its text.
* While a call may be under way the streamed content stops at `<tool_call>`; at the end the
  calls are parsed and the answer carries them with `finish_reason: tool_calls`.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from dlm_protocol.structure_shapes import json_value

from .decoding.constraint_limits import check_schema, schema_patterns
from .decoding.grammar import MAX_CONSTRAINT_CHARS, Constraint
from .errors import InvalidRequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# JSON inside a call exactly as the Qwen2.5 / Dream template writes it (and never free
# whitespace: a model that does not know when to stop cannot pad forever)
_JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

# The instructions Qwen2.5-style templates render, for templates that have no tools of their own
_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolSpec:
    """A request's resolved tools: OpenAI's tool objects, how they may be used."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # auto | required | function
    name: str | None = None  # the function `tool_choice` names
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def tool_list(self) -> list[dict[str, Any]]:
        return [copy.deepcopy(t) for t in self.tools]


def resolve_tools(tools: Any, tool_choice: Any, parallel: bool) -> ToolSpec | None:
    """The request's tools (None: no tools, or `tool_choice: none`); raises naming the field.
    Shapes were checked by the contract; here the rules across keys."""
    tools = json_value(tools) if tools is not None else None
    if isinstance(tool_choice, str) and tool_choice[:1] == "{":
        tool_choice = json_value(tool_choice)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if not tools:
        if choice not in ("none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InvalidRequestError("tools", f"function {dup!r} is given twice")
    if len(json.dumps(tools)) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError("tools", f"longer than {MAX_CONSTRAINT_CHARS} characters")
    if choice == "none":
        return None
    name = None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise InvalidRequestError(
                "tool_choice", f"names function {name!r}, which is not in tools"
            )
        choice = "function"
    return ToolSpec(tuple(tools), choice, name, bool(parallel))


def tool_constraint(spec: ToolSpec) -> Constraint | None:
    """For `required` / a named function: the grammar of the answers allowed (one call, or with
    `required` and parallel calls one or more), arguments valid against each function's
    `parameters` schema. None for `auto`."""
    if not spec.constrained:
        return None
    tools = [t for t in spec.tools if spec.name is None or t["function"]["name"] == spec.name]
    rules, patterns = [], ()
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = dict(fn.get("parameters") or {"type": "object"})
        check_schema("tools", schema)  # nesting and $refs, before llguidance compiles it
        patterns += schema_patterns(schema)
        schema["x-guidance"] = {**_JSON_LAYOUT, **schema.get("x-guidance", {})}
        head = f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": '
        tail = f"}}\n{TOOL_CALL_CLOSE}"
        rules.append(f"call_{i}: {json.dumps(head)} %json {json.dumps(schema)} {json.dumps(tail)}")
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    many = spec.choice == "required" and spec.parallel
    start = 'start: call ("\\n" call)*' if many else "start: call"
    lark = "\n".join([start, f"call: {calls}", *rules])
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as exc:  # llguidance names what it could not compile
        raise InvalidRequestError("tools", f"cannot compile the parameters: {exc}") from None
    return Constraint("tools", "tool_calls", grammar, patterns=patterns)


# ---- the prompt ------------------------------------------------------------------------------


def template_has_tools(tokenizer: Any) -> bool:
    """Does the checkpoint's chat template render `tools` itself?"""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "tool_use" in template or any("tools" in t for t in template.values())
    return isinstance(template, str) and "tools" in template


def _arguments(value: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates write them with `tojson`."""
    parsed = json_value(value)
    return parsed if isinstance(parsed, dict) else value


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    body = {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments", {}))}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def prompt_messages(
    messages: list[dict[str, Any]], spec: ToolSpec | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (and the `tools` argument) for `apply_chat_template`. `native`: the template
    renders tools, tool results and assistant calls itself; otherwise they become text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m["tool_calls"] = [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": _arguments(c["function"].get("arguments", {})),
                        },
                    }  # fmt: skip
                    for c in calls
                ]
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
            continue
        if m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
            continue
        text = m.get("content") or ""
        if calls:
            text = "\n".join([text, *(_call_text(c) for c in calls)]).lstrip("\n")
        out.append({"role": m["role"], "content": text})
    if spec is None:
        return out, None
    if native:
        return out, spec.tool_list()
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.tools)
    prompt = _TOOLS_PROMPT.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


# ---- the answer ------------------------------------------------------------------------------


def parse_tool_calls(text: str, spec: ToolSpec) -> tuple[str, list[dict[str, Any]] | None]:
    """(content, calls): the text before the first `<tool_call>` and the calls in OpenAI's
    shape, or (text, None) when the text holds no well-formed call of a known function."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return text, None
    calls, pos = [], start
    # numbers stay as written (a grammar-valid 1e999 is no float), NaN / Infinity are no JSON
    decoder = json.JSONDecoder(parse_float=_Number, parse_constant=_no_constant)
    while pos >= 0:
        body = text[pos + len(TOOL_CALL_OPEN) :].lstrip()
        try:
            obj, end = decoder.raw_decode(body)
        except ValueError:  # JSONDecodeError too
            return text, None
        rest = body[end:].lstrip()
        if not rest.startswith(TOOL_CALL_CLOSE) and rest:
            return text, None
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = decoder.decode(args)
            except ValueError:  # JSONDecodeError too
                return text, None
        name = obj.get("name") if isinstance(obj, dict) else None
        if name not in spec.names or not isinstance(args, dict):
            return text, None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": _dump(args)},
            }
        )
        if not rest:
            break
        after = len(text) - len(rest) + len(TOOL_CALL_CLOSE)
        pos = text.find(TOOL_CALL_OPEN, after)
    if not spec.parallel:
        calls = calls[:1]
    return text[:start], calls


class _Number(str):
    """A JSON number with a fraction or exponent, kept as written."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _dump(value: Any) -> str:
    """JSON text of parsed arguments, numbers as the model wrote them."""
    if isinstance(value, _Number):
        return str.__str__(value)
    if isinstance(value, dict):
        items = (f"{json.dumps(k, ensure_ascii=False)}: {_dump(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dump(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


class ToolCallText:
    """One request's streamed content with tools: text is released only up to a possible
    `<tool_call>` (a tail that could begin one is held back); at the end the calls are parsed,
    and text that held no call is released after all."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.sent = ""

    def update(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]] | None]:
        """(new content, the calls on the final update or None)."""
        calls = None
        if finished:
            content, calls = parse_tool_calls(text, self.spec)
            visible = content if calls else text
        else:
            cut = text.find(TOOL_CALL_OPEN)
            visible = text if cut < 0 else text[:cut]
            for n in range(min(len(TOOL_CALL_OPEN) - 1, len(visible)), 0, -1):
                if visible.endswith(TOOL_CALL_OPEN[:n]):
                    visible = visible[:-n]
                    break
        if not visible.startswith(self.sent):
            return "", calls
        delta, self.sent = visible[len(self.sent) :], visible
        return delta, calls
