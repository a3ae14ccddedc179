"""What a tool-call syntax is to the engine: the markup a model family's chat template teaches
for calls, how a constrained call is written, and how calls are read back from the text.

Each family names its syntax (`Family.tool_format`); `tools.py` turns the name into a
`ToolFormat` bound to the checkpoint's tokenizer (some markup is a single special token) and
does everything format-neutral: resolving the request's tools, the prompt, the budget and the
streamed content. Formats: Hermes / Qwen2.5 JSON in `<tool_call>` tags (`tools.py`), Gemma 4's
`<|tool_call>call:name{...}<tool_call|>` (`tool_gemma4.py`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tools import ToolSpec


@dataclass(frozen=True)
class ToolAnswer:
    """An answer's text read for calls: the content before the first call's markup (never any
    markup), the calls in OpenAI's shape, and whether the last one was cut off unfinished."""

    content: str
    calls: list[dict[str, Any]]
    cut: bool = False
    markup: bool = False  # the text held call markup (whether or not a call came of it)


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """One call in OpenAI's shape (`arguments` as JSON text)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


@dataclass(frozen=True)
class ValueSyntax:
    """How a format writes argument values, for the shortest-arguments walk of the budget."""

    item_sep: str
    key_sep: str
    quote: str | None = None  # a string's delimiter written as is (None: JSON strings)
    bare_keys: bool = False

    def string(self, text: str) -> str:
        if self.quote is None:
            return json.dumps(text, ensure_ascii=False)
        return f"{self.quote}{text}{self.quote}"

    def key(self, name: str) -> str:
        return name if self.bare_keys else self.string(name)

    def literal(self, value: Any) -> str:
        """A JSON value (an `enum` / `const` choice) as the format writes it."""
        if isinstance(value, str):
            return self.string(value)
        if isinstance(value, dict):
            items = (f"{self.key(k)}{self.key_sep}{self.literal(v)}" for k, v in value.items())
            return "{" + self.item_sep.join(items) + "}"
        if isinstance(value, list):
            return "[" + self.item_sep.join(self.literal(v) for v in value) + "]"
        return json.dumps(value)


JSON_SYNTAX = ValueSyntax(item_sep=", ", key_sep=": ")


class ToolFormat:
    """One tool-call syntax. Subclasses set the markup and implement the methods."""

    name = ""
    open = ""  # the markup that begins a call: streamed content stops there
    close = ""
    syntax = JSON_SYNTAX
    # markup strings the answer's text keeps although the tokenizer marks them special
    # (decoding skips special tokens): token id -> text
    kept: dict[int, str] = {}
    # tokens that close a piece of a call where the structure-closing characters do not
    # (a delimiter or separator of the format), preferred when a call must end
    closing_ids: tuple[int, ...] = ()

    def clean(self, content: str) -> str:
        """Content as shown: the markup the text keeps for the parser, where the model wrote
        it outside a call, is not content (decoding would have skipped it)."""
        for text in self.kept.values():
            content = content.replace(text, "")
        return content

    def grammar(self, spec: ToolSpec) -> str:
        """The Lark grammar (llguidance) of the answers `required` / a named function allow."""
        raise NotImplementedError

    def parse(self, text: str, spec: ToolSpec, cut: bool = False) -> ToolAnswer:
        """The calls in `text` (see `tools.parse_tool_calls`)."""
        raise NotImplementedError

    def call(self, name: str, arguments: str) -> str:
        """A whole call of `name` whose arguments are written `arguments` (in this syntax)."""
        raise NotImplementedError

    @property
    def tail(self) -> str:
        """What a call still needs once its arguments closed."""
        raise NotImplementedError

    def call_text(self, name: str, arguments: Any) -> str:
        """An earlier call (arguments parsed, or as sent) for a template without tools."""
        raise NotImplementedError

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The tool list and the call syntax, for a template without tools."""
        raise NotImplementedError

    def result_text(self, name: str, content: str) -> str:
        """A tool result, for a template without tools."""
        raise NotImplementedError


class Number(str):
    """A JSON number with a fraction or exponent, kept as written (a grammar-valid 1e999 is
    no float)."""


def dump_arguments(value: Any) -> str:
    """JSON text of parsed arguments, numbers as the model wrote them."""
    if isinstance(value, Number):
        return str.__str__(value)
    if isinstance(value, dict):
        items = (
            f"{json.dumps(k, ensure_ascii=False)}: {dump_arguments(v)}" for k, v in value.items()
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dump_arguments(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)
