"""Tool calls: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` for a
diffusion model.

* A model family writes calls in the syntax its chat template teaches (`Family.tool_format`,
  `tool_format.py`): Hermes / Qwen2.5 (LLaDA, Dream, SDAR, LLaDA2:
  ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, several separated by a
  newline) or Gemma 4's (DiffusionGemma: ``<|tool_call>call:f{key:value}<tool_call|>``,
  `tool_gemma4.py`). The engine binds its family's format to each request's tools.
* The tool list reaches the model through the checkpoint's chat template
  (`apply_chat_template(tools=...)`) when the template knows tools (Dream's, Qwen2.5's,
  Gemma 4's); a template without tools (LLaDA's) gets the format's instructions as a system
  message. Tool results (`role: tool`) and earlier assistant calls go back through the
  template, or, for a template without tools, as the format's text in user / assistant turns.
* `required` and a named function constrain the output with the structured-output machinery
  (`decoding/constraints.py`): an llguidance Lark grammar of the format's calls whose
  arguments follow the function's `parameters` schema, so every finished answer's arguments
  parse and validate. `auto` leaves the model free and parses calls from its text.
* While a call may be under way the streamed content stops at the format's opening markup; at
  the end the calls are parsed and the answer carries them with `finish_reason: tool_calls`.
  No markup is ever content: a call cut inside its arguments by `max_tokens` comes as it
  stands, with `finish_reason: length`, as OpenAI answers one.
* A constrained call keeps room at the end of its canvas for the shortest arguments its schema
  needs and the closing markup; a `max_tokens` that cannot hold the smallest call is refused.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import llguidance

from dlm_protocol.structure_shapes import json_value
from dlm_protocol.tool_rules import check_tool_names

from .decoding.constraint_limits import check_schema, schema_patterns
from .decoding.grammar import MAX_CONSTRAINT_CHARS, Constraint
from .errors import InvalidRequestError
from .tool_format import (
    JSON_SYNTAX,
    Number,
    ToolAnswer,
    ToolFormat,
    ValueSyntax,
    dump_arguments,
    new_call,
)
from .tool_gemma4 import Gemma4Format, without_open_tail

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


class HermesFormat(ToolFormat):
    """Hermes / Qwen2.5 calls: JSON objects in `<tool_call>` tags, one per line."""

    name = "hermes"
    open, close = TOOL_CALL_OPEN, TOOL_CALL_CLOSE
    syntax = JSON_SYNTAX

    def grammar(self, spec: ToolSpec) -> str:
        tools = [t for t in spec.tools if spec.name is None or t["function"]["name"] == spec.name]
        rules = []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            schema = dict(fn.get("parameters") or {"type": "object"})
            schema["x-guidance"] = {**_JSON_LAYOUT, **schema.get("x-guidance", {})}
            head = f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": '
            tail = f"}}\n{TOOL_CALL_CLOSE}"
            rules.append(
                f"call_{i}: {json.dumps(head)} %json {json.dumps(schema)} {json.dumps(tail)}"
            )
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        many = spec.choice == "required" and spec.parallel
        start = 'start: call ("\\n" call)*' if many else "start: call"
        return "\n".join([start, f"call: {calls}", *rules])

    def call(self, name: str, arguments: str) -> str:
        return (
            f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}{self.tail}'
        )

    @property
    def tail(self) -> str:
        return f"}}\n{TOOL_CALL_CLOSE}"

    def call_text(self, name: str, arguments: Any) -> str:
        body = {"name": name, "arguments": arguments}
        return f"{TOOL_CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return _TOOLS_PROMPT.format(tools=listing)

    def result_text(self, name: str, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def parse(self, text: str, spec: ToolSpec, cut: bool = False) -> ToolAnswer:
        return _parse_hermes(text, spec, cut)


HERMES = HermesFormat()
# each family's syntax by name (`Family.tool_format`), made for the checkpoint's tokenizer
TOOL_FORMATS: dict[str, Callable[[Any], ToolFormat]] = {
    "hermes": lambda tokenizer: HERMES,
    "gemma4": Gemma4Format.for_tokenizer,
}


def tool_format(name: str, tokenizer: Any) -> ToolFormat:
    """The family's tool-call syntax for this tokenizer."""
    return TOOL_FORMATS[name](tokenizer)


@dataclass(frozen=True)
class ToolSpec:
    """A request's resolved tools: OpenAI's tool objects, how they may be used, and the
    syntax the model writes calls in (its family's, bound by the engine)."""

    tools: tuple[dict[str, Any], ...]
    choice: str  # auto | required | function
    name: str | None = None  # the function `tool_choice` names
    parallel: bool = True
    format: ToolFormat = field(default=HERMES, compare=False)

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
    check_tool_names(tools)
    names = [t["function"]["name"] for t in tools]
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
    `required` and parallel calls one or more), in the spec's format, arguments valid against
    each function's `parameters` schema. None for `auto`."""
    if not spec.constrained:
        return None
    patterns: tuple[str, ...] = ()
    for tool in spec.tools:
        if spec.name is None or tool["function"]["name"] == spec.name:
            schema = tool["function"].get("parameters") or {"type": "object"}
            check_schema("tools", schema)  # nesting and $refs, before a grammar is written
            patterns += schema_patterns(schema)
    lark = spec.format.grammar(spec)
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as exc:  # llguidance names what it could not compile
        raise InvalidRequestError("tools", f"cannot compile the parameters: {exc}") from None
    return Constraint("tools", "tool_calls", grammar, patterns=patterns)


def bind_format(resolved: Any, fmt: ToolFormat) -> Any:
    """Resolved params whose tools are written in `fmt` (the engine's family's syntax): the
    spec carries the format and a constrained call's grammar is the format's."""
    spec = resolved.tools
    if spec is None or spec.format is fmt:
        return resolved
    spec = replace(spec, format=fmt)
    constraint = tool_constraint(spec) if spec.constrained else resolved.constraint
    return replace(resolved, tools=spec, constraint=constraint)


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


def prompt_messages(
    messages: list[dict[str, Any]],
    spec: ToolSpec | None,
    native: bool,
    fmt: ToolFormat = HERMES,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (and the `tools` argument) for `apply_chat_template`. `native`: the template
    renders tools, tool results and assistant calls itself; otherwise they become text in
    `fmt`, the model's call syntax."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function, for the results that answer them
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
            name = names.get(m.get("tool_call_id") or "", "")
            out.append({"role": "user", "content": fmt.result_text(name, m["content"])})
            continue
        text = m.get("content") or ""
        for c in calls:
            fn = c.get("function", c)
            if isinstance(c.get("id"), str):
                names[c["id"]] = fn.get("name")
            call = fmt.call_text(fn.get("name"), _arguments(fn.get("arguments", {})))
            text = "\n".join([text, call]).lstrip("\n")
        out.append({"role": m["role"], "content": text})
    if spec is None:
        return out, None
    if native:
        return out, spec.tool_list()
    prompt = fmt.tools_prompt(list(spec.tools))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


# ---- the budget ------------------------------------------------------------------------------


def smallest_call(name: str, arguments: str = "{}") -> str:
    """A Hermes call of `name` as a constrained answer writes it (arguments `{}` by default)."""
    return HERMES.call(name, arguments)


def shortest_json(
    schema: Any, longest_choice: bool = False, syntax: ValueSyntax = JSON_SYNTAX
) -> str:
    """A short text of an arguments schema in the calls' layout (`syntax`: JSON as Hermes
    writes it, or another format's): each required key with its own shortest value. Never
    longer than the shortest valid arguments (a lower bound, for refusing a budget no call
    fits), except that `longest_choice` takes the longest value of an `enum` a model may pick
    (for the room to keep). What it does not follow (`$ref`, ...) counts as the shortest JSON
    value; its work and length are bounded, whatever the schema."""
    if not isinstance(schema, dict):
        return "{}"
    return _Shortest(longest_choice, syntax).value(schema, 0)


class _Shortest:
    """One walk of `shortest_json`: at most `NODES` schema nodes, `CHARS` characters a value."""

    NODES, CHARS, DEPTH = 2000, 4096, 16

    def __init__(self, longest_choice: bool, syntax: ValueSyntax) -> None:
        self.pick = max if longest_choice else min
        self.syntax = syntax
        self.nodes = 0

    def value(self, schema: Any, depth: int) -> str:
        self.nodes += 1
        if not isinstance(schema, dict) or depth > self.DEPTH or self.nodes > self.NODES:
            return "{}" if depth == 0 else "0"
        lit = self.syntax.literal
        if "const" in schema:
            return lit(schema["const"])[: self.CHARS]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            texts = (lit(v)[: self.CHARS] for v in schema["enum"])
            return self.pick(texts, key=len)
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            return min((self.value(b, depth + 1) for b in branches), key=len)
        kind = schema.get("type")
        if isinstance(kind, list) and kind:  # each type alone, the shortest
            return min((self.value({**schema, "type": k}, depth + 1) for k in kind), key=len)
        if kind == "string":
            return self.syntax.string("a" * _count(schema.get("minLength")))
        if kind in ("integer", "number"):
            return "0"
        if kind in ("boolean", "null"):
            return "true" if kind == "boolean" else "null"
        sep = self.syntax.item_sep
        if kind == "array":
            item = self.value(schema.get("items"), depth + 1)
            return ("[" + sep.join([item] * _count(schema.get("minItems"))) + "]")[: self.CHARS]
        if kind not in (None, "object") or (depth and kind is None and "properties" not in schema):
            return "0"
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        items = (
            f"{self.syntax.key(k)}{self.syntax.key_sep}{self.value(props.get(k), depth + 1)}"
            for k in required[:64]
            if isinstance(k, str)
        )
        return ("{" + sep.join(items) + "}")[: self.CHARS]


def _count(value: Any) -> int:
    return min(value, 64) if isinstance(value, int) and not isinstance(value, bool) else 0


def _allowed(spec: ToolSpec) -> list[dict[str, Any]]:
    return [t["function"] for t in spec.tools if spec.name in (None, t["function"]["name"])]


def check_call_budget(spec: ToolSpec | None, max_tokens: int, tokenizer: Any) -> None:
    """`required` / a named function: `max_tokens` must hold at least the smallest call of an
    allowed function, or no answer could ever be a call (a 400 naming `max_tokens` instead of
    an answer cut inside its markup)."""
    if spec is None or not spec.constrained:
        return
    fmt = spec.format
    need = min(
        len(tokenizer.encode(fmt.call(fn["name"], shortest_json(fn.get("parameters"),
                                                                 syntax=fmt.syntax)),
                             add_special_tokens=False))
        for fn in _allowed(spec)
    )  # fmt: skip
    if max_tokens < need:
        which = f"a call of {spec.name!r}" if spec.name else "the smallest tool call"
        raise InvalidRequestError(
            "max_tokens",
            f"{max_tokens} cannot hold {which} (tool_choice {spec.choice}): it takes "
            f"at least {need} tokens",
        )


def closing_reserve(spec: ToolSpec | None, tokenizer: Any) -> int:
    """Tokens a constrained call keeps at the end of its canvas, besides the structure's own
    reserve, to finish: the shortest arguments the schema needs (the longest `enum` choice) and
    the closing markup, so a call whose model has not learned to stop is closed, not cut."""
    if spec is None or not spec.constrained:
        return 0
    fmt = spec.format
    return max(
        len(tokenizer.encode(shortest_json(fn.get("parameters"), True, fmt.syntax) + fmt.tail,
                             add_special_tokens=False))
        for fn in _allowed(spec)
    )  # fmt: skip


# ---- the answer ------------------------------------------------------------------------------


def parse_tool_calls(text: str, spec: ToolSpec, cut: bool = False) -> ToolAnswer:
    """The calls in `text`, in the spec's format. Each well-formed call of a known function
    is returned; a call whose markup is malformed or names an unknown function is dropped.
    `cut`: the text was cut by `max_tokens`, so a last call it ends inside is returned as it
    stands (OpenAI's answer to a cut call: its name and the arguments so far), or whole when
    its arguments were complete and only the closing markup was cut."""
    return spec.format.parse(text, spec, cut)


# A call's start as far as the text got: its name (whole when the quote closed) and the
# arguments written so far (Hermes / Qwen2.5 order, as the constrained grammar writes it)
_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)(?P<closed>")?'
    r'(?:\s*,\s*"(?:arguments|parameters)"\s*:\s*(?P<args>.*))?',
    re.DOTALL,
)


def _parse_hermes(text: str, spec: ToolSpec, cut: bool) -> ToolAnswer:
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ToolAnswer(without_open_tail(text, TOOL_CALL_OPEN) if cut else text, [])
    calls: list[dict[str, Any]] = []
    unfinished = False
    # numbers stay as written (a grammar-valid 1e999 is no float), NaN / Infinity are no JSON
    decoder = json.JSONDecoder(parse_float=Number, parse_constant=_no_constant)
    pos = start
    while pos >= 0:
        at = pos + len(TOOL_CALL_OPEN)
        at += len(text[at:]) - len(text[at:].lstrip())
        body = text[at:]
        try:
            obj, end = decoder.raw_decode(body)
        except ValueError:  # JSONDecodeError too: malformed, or the text ends inside it
            close = text.find(TOOL_CALL_CLOSE, at)
            if close < 0:
                call = _cut_call(body, spec, decoder) if cut else None
                if call is not None:
                    calls.append(call[0])
                    unfinished = call[1]
                break
            pos = text.find(TOOL_CALL_OPEN, close + len(TOOL_CALL_CLOSE))
            continue
        rest = body[end:].lstrip()
        # closed, or the text ends inside the closing tag (or before it): the call is whole
        closed = rest.startswith(TOOL_CALL_CLOSE) or TOOL_CALL_CLOSE.startswith(rest)
        call = _whole_call(obj, spec, decoder) if closed else None
        if call is not None:
            calls.append(call)
        close = text.find(TOOL_CALL_CLOSE, at + end)
        if close < 0:
            break
        pos = text.find(TOOL_CALL_OPEN, close + len(TOOL_CALL_CLOSE))
    if not spec.parallel:
        unfinished = unfinished and len(calls) == 1
        calls = calls[:1]
    return ToolAnswer(text[:start], calls, unfinished, markup=True)


def _whole_call(obj: Any, spec: ToolSpec, decoder: json.JSONDecoder) -> dict[str, Any] | None:
    """A parsed call object in OpenAI's shape; None when it is no call of a known function."""
    if not isinstance(obj, dict):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = decoder.decode(args)
        except ValueError:  # JSONDecodeError too
            return None
    name = obj.get("name")
    if name not in spec.names or not isinstance(args, dict):
        return None
    return new_call(name, dump_arguments(args))


def _cut_call(
    body: str, spec: ToolSpec, decoder: json.JSONDecoder
) -> tuple[dict[str, Any], bool] | None:
    """(call, unfinished) for a call the text ends inside; None when not even its function is
    known (a name cut where several functions begin alike)."""
    if body and not body.startswith("{"):
        return None
    allowed = (spec.name,) if spec.name is not None else spec.names
    m = _CALL_HEAD.match(body)
    if m is None:
        names = list(allowed)
    elif m["closed"]:
        names = [m["name"]] if m["name"] in allowed else []
    else:
        names = [n for n in allowed if n.startswith(m["name"])]
    if len(names) != 1:
        return None
    written = (m["args"] or "").rstrip() if m is not None else ""
    try:  # the arguments are whole; only what closes the call is missing
        args, end = decoder.raw_decode(written)
        if isinstance(args, dict) and not written[end:].strip(" }\n"):
            return new_call(names[0], dump_arguments(args)), False
    except ValueError:  # JSONDecodeError too
        pass
    return new_call(names[0], written), True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class ToolCallText:
    """One request's streamed content with tools: text is released only up to a possible
    call (a tail that could begin the format's opening markup is held back); at the end the
    calls are parsed and the text before the first call's markup is the content, so no
    markup is ever content."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.sent = ""
        self.answer: ToolAnswer | None = None  # set by the final update

    def update(
        self, text: str, finished: bool, cut: bool = False
    ) -> tuple[str, list[dict[str, Any]] | None]:
        """(new content, the calls on the final update or None). `cut`: the text ended at
        `max_tokens`."""
        calls = None
        fmt = self.spec.format
        if finished:
            self.answer = parse_tool_calls(text, self.spec, cut)
            visible, calls = fmt.clean(self.answer.content), self.answer.calls or None
        else:
            cut_at = text.find(fmt.open)
            visible = fmt.clean(without_open_tail(text if cut_at < 0 else text[:cut_at], fmt.open))
        if not visible.startswith(self.sent):
            return "", calls
        delta, self.sent = visible[len(self.sent) :], visible
        return delta, calls
