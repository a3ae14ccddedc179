"""Gemma 4's tool-call syntax (DiffusionGemma's family), as its chat template writes calls:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>c<|"|>}<tool_call|>

Several calls follow each other with nothing between them, and the turn then ends with
`<|tool_response>` (where the template puts the results; the family stops there). Argument
values are written without whitespace: strings between `<|"|>` delimiters, as they are (no
escapes); numbers, `true` / `false`, `null` as in JSON; objects `{key:value,...}` with bare
keys, in sorted order as the template writes them; arrays `[a,b]`. In Gemma 4's tokenizer the
markup and the delimiter are single special tokens: the grammar names them as tokens (when
the checkpoint's tokenizer has them) and the answer's text keeps them for the parser.

`tool_choice` required / a named function constrain the answer with a Lark grammar written
here from each function's `parameters` (llguidance's `%json` writes JSON, whose strings and
keys differ): types, `enum` / `const`, `anyOf` / `oneOf`, required and optional properties,
array and string lengths, and numbers through `%json` (the same text in both syntaxes). A
string never contains `<|` (where every piece of markup begins). What the grammar cannot
follow (`pattern`, `format`, `$ref`, keys that are not bare words, ...) is refused naming
`tools`, so every constrained call parses and validates.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequestError
from .tool_format import Number, ToolAnswer, ToolFormat, ValueSyntax, dump_arguments, new_call

if TYPE_CHECKING:
    from .tools import ToolSpec

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
TOOL_OPEN, TOOL_CLOSE = "<|tool>", "<tool|>"
RESULT_OPEN, RESULT_CLOSE = "<|tool_response>", "<tool_response|>"
MARKUP = (OPEN, CLOSE, QUOTE, TOOL_OPEN, TOOL_CLOSE, RESULT_OPEN, RESULT_CLOSE)
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_NAME = re.compile(r"call:([A-Za-z0-9_-]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# keywords a constrained call cannot honour in this syntax (refused rather than broken)
UNSUPPORTED = (
    "pattern", "format", "$ref", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "prefixItems", "contains", "uniqueItems", "not", "allOf", "if",
    "dependentRequired", "dependentSchemas", "unevaluatedProperties", "multipleOf",
)  # fmt: skip
_NUMERIC = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_FREE_KEY = "/[A-Za-z_][A-Za-z0-9_]{0,31}/"  # a key the schema does not name: a short word


class Gemma4Format(ToolFormat):
    """Gemma 4's calls for one tokenizer: which markup it holds as special tokens."""

    name = "gemma4"
    open, close = OPEN, CLOSE
    syntax = ValueSyntax(item_sep=",", key_sep=":", quote=QUOTE, bare_keys=True)

    def __init__(self, special: dict[str, int] | None = None, colon: int | None = None) -> None:
        self.special = dict(special or {})  # markup text -> its special token id
        self.kept = {i: text for text, i in self.special.items()}
        # near max_tokens: the delimiter token ends a string, ":" a key
        ids = [self.special.get(QUOTE), colon]
        self.closing_ids = tuple(i for i in ids if i is not None)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> Gemma4Format:
        """The markup this tokenizer holds as single special (added) tokens."""
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = {t.content: i for i, t in added.items() if t.special and t.content in MARKUP}
        colon = tokenizer.encode(":", add_special_tokens=False)
        return cls(special, colon[0] if len(colon) == 1 else None)

    def token(self, text: str) -> str:
        """`text` in a Lark grammar: the special token by name, else the characters."""
        return text if text in self.special else json.dumps(text)

    # ---- the constrained answer ----------------------------------------------------------

    def grammar(self, spec: ToolSpec) -> str:
        tools = [t for t in spec.tools if spec.name is None or t["function"]["name"] == spec.name]
        g = _Grammar(self)
        calls = []
        for tool in tools:
            fn = tool["function"]
            schema = fn.get("parameters") or {"type": "object"}
            args = g.arguments(schema)
            head = json.dumps(f"call:{fn['name']}")
            calls.append(g.rule(f"{self.token(OPEN)} {head} {args} {self.token(CLOSE)}"))
        many = spec.choice == "required" and spec.parallel
        start = "start: call+" if many else "start: call"
        return "\n".join([start, "call: " + " | ".join(calls), *g.rules])

    def call(self, name: str, arguments: str) -> str:
        return f"{OPEN}call:{name}{arguments}{CLOSE}"

    @property
    def tail(self) -> str:
        return "}" + CLOSE

    # ---- the prompt for a template without tools ------------------------------------------

    def call_text(self, name: str, arguments: Any) -> str:
        if isinstance(arguments, dict):
            return self.call(name, self.syntax.literal(_sorted(arguments)))
        return self.call(name, str(arguments))

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        lit = self.syntax.literal
        declarations = "".join(
            f"{TOOL_OPEN}declaration:{t['function']['name']}"
            f"{{description:{lit(t['function'].get('description') or '')},"
            f"parameters:{lit(t['function'].get('parameters') or {'type': 'object'})}}}"
            f"{TOOL_CLOSE}"
            for t in tools
        )
        return (
            f"You can call these functions:\n{declarations}\n\nTo call one, write "
            f"{OPEN}call:NAME{{key:value,...}}{CLOSE} (strings between {QUOTE} marks)."
        )

    def result_text(self, name: str, content: str) -> str:
        return f"{RESULT_OPEN}response:{name}{{value:{QUOTE}{content}{QUOTE}}}{RESULT_CLOSE}"

    # ---- the answer -----------------------------------------------------------------------

    def parse(self, text: str, spec: ToolSpec, cut: bool = False) -> ToolAnswer:
        start = text.find(OPEN)
        if start < 0:
            return ToolAnswer(without_open_tail(text, OPEN) if cut else text, [])
        calls: list[dict[str, Any]] = []
        unfinished = False
        allowed = (spec.name,) if spec.name is not None else spec.names
        pos = start
        while pos >= 0:
            m = _NAME.match(text, pos + len(OPEN))
            rest = text[pos + len(OPEN) :]
            if m is None or m.end() == len(text):  # the text ends in its head, or malformed
                if cut and (m is not None or "call:".startswith(rest)):
                    names = [n for n in allowed if n.startswith(m[1] if m else "")]
                    if len(names) == 1:
                        calls.append(new_call(names[0], ""))
                        unfinished = True
                if m is None and not (cut and "call:".startswith(rest)):
                    pos = text.find(OPEN, pos + len(OPEN))
                    continue
                break
            name, at = m[1], m.end()
            reader = _Reader(text, at)
            try:
                args = reader.object()
            except _Truncated:
                if cut and name in allowed:
                    calls.append(new_call(name, json_prefix(text[at:])))
                    unfinished = True
                break
            except ValueError:  # malformed: no call
                pos = text.find(OPEN, at)
                continue
            tail = text[reader.pos :]
            closed = tail.startswith(CLOSE) or CLOSE.startswith(tail)
            if closed and name in spec.names:
                calls.append(new_call(name, dump_arguments(args)))
            pos = text.find(OPEN, reader.pos)
        if not spec.parallel:
            unfinished = unfinished and len(calls) == 1
            calls = calls[:1]
        return ToolAnswer(text[:start], calls, unfinished, markup=True)


def without_open_tail(text: str, open_: str) -> str:
    """`text` less a tail that begins `open_` (a call cut before its tag was whole)."""
    for n in range(min(len(open_) - 1, len(text)), 0, -1):
        if text.endswith(open_[:n]):
            return text[:-n]
    return text


def _sorted(value: Any) -> Any:
    """Objects with their keys in order, as the template's `dictsort` writes them."""
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


class _Truncated(Exception):
    """The text ends inside the value."""


class _Reader:
    """A recursive-descent reader of one argument value at `pos` (ValueError: malformed)."""

    def __init__(self, text: str, pos: int) -> None:
        self.text = text
        self.pos = pos

    def _peek(self) -> str:
        if self.pos >= len(self.text):
            raise _Truncated
        return self.text[self.pos]

    def value(self) -> Any:
        t, c = self.text, self._peek()
        if t.startswith(QUOTE, self.pos):
            return self._string()
        if QUOTE.startswith(t[self.pos :]):
            raise _Truncated
        if c == "{":
            return self.object()
        if c == "[":
            return self._array()
        if c == '"':  # a JSON string now and then
            try:
                value, end = json.JSONDecoder().raw_decode(t, self.pos)
            except ValueError:
                if '"' not in t[self.pos + 1 :]:
                    raise _Truncated from None
                raise
            self.pos = end
            return value
        for word, value in (("true", True), ("false", False), ("null", None)):
            if t.startswith(word, self.pos):
                self.pos += len(word)
                return value
            if word.startswith(t[self.pos :]):
                raise _Truncated
        m = _NUMBER.match(t, self.pos)
        if m is None:
            raise ValueError(f"no value at {self.pos}")
        self.pos = m.end()
        if self.pos == len(t):
            raise _Truncated  # the number may go on
        text = m[0]
        return Number(text) if any(ch in text for ch in ".eE") else int(text)

    def _string(self) -> str:
        start = self.pos + len(QUOTE)
        end = self.text.find(QUOTE, start)
        if end < 0:
            raise _Truncated
        self.pos = end + len(QUOTE)
        return self.text[start:end]

    def object(self) -> dict[str, Any]:
        if self._peek() != "{":
            raise ValueError("an object begins with {")
        self.pos += 1
        out: dict[str, Any] = {}
        if self._peek() == "}":
            self.pos += 1
            return out
        while True:
            if self.text.startswith(QUOTE, self.pos):
                key = self._string()
            else:
                m = KEY.match(self.text, self.pos)
                if m is None:
                    self._peek()
                    raise ValueError("a key is a bare word")
                key, self.pos = m[0], m.end()
            if self._peek() != ":":
                raise ValueError("a key is followed by :")
            self.pos += 1
            out[key] = self.value()
            c = self._peek()
            self.pos += 1
            if c == "}":
                return out
            if c != ",":
                raise ValueError("object items are separated by ,")

    def _array(self) -> list[Any]:
        self.pos += 1
        out: list[Any] = []
        if self._peek() == "]":
            self.pos += 1
            return out
        while True:
            out.append(self.value())
            c = self._peek()
            self.pos += 1
            if c == "]":
                return out
            if c != ",":
                raise ValueError("array items are separated by ,")


def json_prefix(text: str) -> str:
    """Arguments cut short, as the JSON text they begin (OpenAI's answer to a cut call: the
    arguments so far): strings quoted and escaped, keys quoted, separators as JSON writes."""
    out: list[str] = []
    stack: list[str] = []
    key_next = False
    i, n = 0, len(text)
    while i < n:
        if text.startswith(QUOTE, i):
            end = text.find(QUOTE, i + len(QUOTE))
            body = text[i + len(QUOTE) : end if end >= 0 else n]
            if end < 0:  # cut in the string, or in its closing delimiter
                body = without_open_tail(body, QUOTE)
            out.append('"' + json.dumps(body, ensure_ascii=False)[1:-1])
            if end < 0:
                break
            out.append('"')
            i = end + len(QUOTE)
            key_next = False
            continue
        if QUOTE.startswith(text[i:]):  # the text ends inside a delimiter
            break
        c = text[i]
        if key_next and KEY.match(text, i):
            m = KEY.match(text, i)
            out.append(json.dumps(m[0]) if m.end() < n else '"' + m[0])
            i, key_next = m.end(), False
            continue
        if c in "{[":
            stack.append(c)
            key_next = c == "{"
        elif c in "}]":
            if stack:
                stack.pop()
            key_next = False
        elif c == ",":
            key_next = bool(stack) and stack[-1] == "{"
            c = ", "
        elif c == ":":
            c = ": "
        out.append(c)
        i += 1
    return "".join(out)


class _Grammar:
    """Lark rules for argument values of the Gemma 4 syntax, one schema node at a time."""

    MAX_RULES = 4000
    DEPTH = 16

    def __init__(self, fmt: Gemma4Format) -> None:
        self.q = fmt.token(QUOTE)
        # where the delimiter is characters a string holds no '"' either: '"' closes
        # structures near max_tokens, so a string must not take it forever
        self.chars = "<" if QUOTE in fmt.special else '<"'
        self.rules: list[str] = []
        self._any: str | None = None

    def rule(self, body: str) -> str:
        if len(self.rules) >= self.MAX_RULES:
            raise InvalidRequestError("tools", "the parameters are too large to constrain")
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def arguments(self, schema: Any) -> str:
        """A function's arguments: always an object (`{}` when the schema names none)."""
        if isinstance(schema, dict) and schema.get("type", "object") == "object":
            return self.value(schema, 0)
        return self.value({"type": "object"}, 0)

    def literal(self, value: Any) -> str:
        if isinstance(value, str):
            if "<|" in value:
                raise InvalidRequestError("tools", f"enum value {value[:40]!r} holds markup")
            return f"{self.q} {json.dumps(value)} {self.q}" if value else f"{self.q} {self.q}"
        if isinstance(value, dict):
            parts = [f"{json.dumps(k + ':')} {self.literal(v)}" for k, v in _sorted(value).items()]
            return '"{" ' + ' "," '.join(parts) + ' "}"' if parts else '"{}"'
        if isinstance(value, list):
            parts = [self.literal(v) for v in value]
            return '"[" ' + ' "," '.join(parts) + ' "]"' if parts else '"[]"'
        return json.dumps(json.dumps(value))

    def value(self, schema: Any, depth: int) -> str:
        if schema is True or schema is None or schema == {}:
            return self.any()
        if not isinstance(schema, dict) or depth > self.DEPTH:
            raise InvalidRequestError("tools", "parameters nest too deep or are no schema")
        for key in UNSUPPORTED:
            if key in schema:
                raise InvalidRequestError(
                    "tools", f"{key!r} cannot be enforced in Gemma 4's call syntax"
                )
        if "const" in schema:
            return self.literal(schema["const"])
        if isinstance(schema.get("enum"), list):
            return "(" + " | ".join(self.literal(v) for v in schema["enum"]) + ")"
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            alts = [self.value({**rest, **b} if isinstance(b, dict) else b, depth + 1)
                    for b in branches]  # fmt: skip
            return self.rule(" | ".join(alts))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.rule(" | ".join(self.value({**schema, "type": k}, depth + 1) for k in kind))
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            return self.rule("%json " + json.dumps({k: schema[k] for k in _NUMERIC if k in schema}))
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(schema, depth)
        if kind == "object" or (kind is None and "properties" in schema):
            return self._object(schema, depth)
        if kind is None:
            return self.any()
        raise InvalidRequestError("tools", f"unknown type {kind!r} in the parameters")

    def _string(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not low and high is None:
            return f"{self.q} {self._body()} {self.q}"
        # counted: no "<" at all
        body = f"/[^{self.chars}]{{{int(low)},{'' if high is None else int(high)}}}/"
        return f"{self.q} {body} {self.q}"

    def _body(self) -> str:
        """A string's text: anything but "<|" (and '"' where the delimiter is characters)."""
        c = self.chars
        return f"/([^{c}]|<+[^{c}|])*<*/"

    def _array(self, schema: dict[str, Any], depth: int) -> str:
        item = self.value(schema.get("items", True), depth + 1)
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) == 0:
            return '"[]"'
        more = "*" if high is None else f"{{0,{int(high) - 1}}}"
        if low <= 1:
            items = f'{item} ("," {item}){more}'
            return self.rule(f'"[" ({items})? "]"' if low == 0 else f'"[" {items} "]"')
        extra = "*" if high is None else f"{{0,{int(high) - low}}}"
        fixed = " ".join([item] + [f'"," {item}'] * (low - 1))
        return self.rule(f'"[" {fixed} ("," {item}){extra} "]"')

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        props = dict(schema.get("properties") or {})
        required = [k for k in schema.get("required") or [] if isinstance(k, str)]
        for key in required:
            props.setdefault(key, True)
        extra = schema.get("additionalProperties", True)
        if not props:
            if extra is False:
                return '"{}"'
            return self._free_object(self.value(extra, depth + 1) if extra is not True else None)
        for key in props:
            if not isinstance(key, str) or not KEY.fullmatch(key):
                raise InvalidRequestError(
                    "tools",
                    f"property {str(key)[:40]!r} is no bare word (Gemma 4 writes keys bare)",
                )
        keys = sorted(props)
        first, rest = '""', '""'  # after the last key: nothing
        for key in reversed(keys):
            item = f"{json.dumps(key + ':')} {self.value(props[key], depth + 1)}"
            optional = key not in required
            first, rest = (
                self.rule(f"{item} {rest}" + (f" | {first}" if optional else "")),
                self.rule(f'"," {item} {rest}' + (f" | {rest}" if optional else "")),
            )
        return self.rule(f'"{{" {first} "}}"')

    def _free_object(self, value: str | None) -> str:
        v = value or self.any()
        pair = self.rule(f'{_FREE_KEY} ":" {v}')
        return self.rule(f'"{{" ({pair} ("," {pair})*)? "}}"')

    def any(self) -> str:
        """Any value (a schema that says nothing), defined once."""
        if self._any is None:
            self._any = name = f"r{len(self.rules)}"
            self.rules.append("")  # reserved: the rule refers to itself
            num = self.rule('%json {"type": "number"}')
            pair = self.rule(f'{_FREE_KEY} ":" {name}')
            string = f"{self.q} {self._body()} {self.q}"
            body = (
                f'{string} | {num} | "true" | "false" | "null" | '
                f'"[" ({name} ("," {name})*)? "]" | "{{" ({pair} ("," {pair})*)? "}}"'
            )
            self.rules[int(name[1:])] = f"{name}: {body}"
        return self._any
