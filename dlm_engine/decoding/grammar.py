"""Compiling a request's structure constraint (JSON schema, regex, choice, Lark/GBNF) with
llguidance, per tokenizer.

The grammar engine is llguidance (a maintained Earley-based matcher that computes token masks);
nothing here parses JSON schemas or regexes itself. `compile_constraint` turns the request's
`response_format` / `regex` / `choice` / `grammar` value into one llguidance grammar, checks it
against the model's tokenizer and raises `InvalidRequestError` naming the field on anything
unsupported or unsatisfiable.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark

from ..errors import InvalidRequestError

CONSTRAINT_KEYS = ("response_format", "regex", "choice", "grammar")
# JSON output is compact (no free whitespace): a model cannot pad an answer with spaces forever.
_JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_CONSTRAINT_CHARS = 200_000


@dataclass(frozen=True)
class Constraint:
    """A compiled, validated grammar (llguidance's JSON form) and where it came from."""

    field: str
    kind: str  # json_object | json_schema | regex | choice | grammar
    grammar: str
    schema: dict[str, Any] | None = None


def coerce_value(name: str, value: Any) -> Any:
    """Request values as JSON: Triton request parameters carry only scalars, so an object
    (`response_format`) or a list (`choice`) may arrive as a JSON string."""
    if name in ("response_format", "choice") and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            if name == "choice":
                raise InvalidRequestError(name, "must be a list of strings") from None
            raise InvalidRequestError(name, "must be a JSON object") from None
    if name in ("regex", "grammar") and value is not None and not isinstance(value, str):
        raise InvalidRequestError(name, "must be a string")
    return value


def parse_constraint(raw: dict[str, Any]) -> Constraint | None:
    """The one constraint a request carries (None without one); the grammar is not yet checked
    against a tokenizer (that happens in `GrammarCompiler.check`)."""
    given = [k for k in CONSTRAINT_KEYS if raw.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"give only one of {', '.join(CONSTRAINT_KEYS)}")
    key = given[0]
    value = raw[key]
    if len(json.dumps(value, default=str)) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(key, f"longer than {MAX_CONSTRAINT_CHARS} characters")
    try:
        if key == "response_format":
            return _response_format(value)
        if key == "regex":
            if not isinstance(value, str) or not value:
                raise InvalidRequestError("regex", "must be a non-empty string")
            return Constraint("regex", "regex", llguidance.LLMatcher.grammar_from_regex(value))
        if key == "choice":
            return _choice(value)
        if not isinstance(value, str) or not value.strip():
            raise InvalidRequestError("grammar", "must be a non-empty Lark or GBNF string")
        return Constraint(
            "grammar", "grammar", llguidance.LLMatcher.grammar_from_lark(_lark(value))
        )
    except InvalidRequestError:
        raise
    except Exception as exc:  # llguidance's own message names what it could not compile
        raise InvalidRequestError(key, f"cannot compile: {exc}") from None


def _lark(text: str) -> str:
    """Lark as given; GBNF (`root ::= ...`) converted by llguidance's own converter."""
    try:
        return any_to_lark(text)
    except Exception as exc:
        raise InvalidRequestError("grammar", f"cannot read as Lark or GBNF: {exc}") from None


def _choice(value: Any) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequestError("choice", "must be a non-empty list of non-empty strings")
    body = " | ".join(json.dumps(c) for c in value)
    return Constraint("choice", "choice", llguidance.LLMatcher.grammar_from_lark(f"start: {body}"))


def _response_format(value: Any) -> Constraint | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError(field, "must be an object with a string 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        return Constraint(field, "json_object", grammar, schema)
    if kind != "json_schema":
        raise InvalidRequestError(f"{field}.type", "must be one of text, json_object, json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError(f"{field}.json_schema", "must be an object")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{field}.json_schema.schema", "must be a JSON schema object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    except Exception as exc:
        raise InvalidRequestError(f"{field}.json_schema.schema", str(exc)) from None
    return Constraint(field, "json_schema", grammar, schema)


def error_field(c: Constraint) -> str:
    return f"{c.field}.json_schema.schema" if c.kind == "json_schema" else c.field


def ll_tokenizer(hf_tokenizer: Any, n_vocab: int, eos_id: int) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer: its own reader of `tokenizer.json` for the
    byte-level BPE / sentencepiece layouts of LLaDA and Dream, else (the character-level
    tokenizers of tiny-dlm and the test checkpoints) each token's decoded bytes."""
    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_id)
    except ValueError:
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_DecodedVocab(hf_tokenizer, eos_id, n_vocab)),
            n_vocab=n_vocab,
        )


class _DecodedVocab:
    """The attributes `llguidance.TokenizerWrapper` reads, from a tokenizer's decode()."""

    def __init__(self, hf_tokenizer: Any, eos_id: int, n_vocab: int) -> None:
        n = len(hf_tokenizer)
        self._hf = hf_tokenizer
        self.eos_token_id = eos_id
        self.bos_token_id = hf_tokenizer.bos_token_id
        special = set(hf_tokenizer.all_special_ids) | {
            i for i, t in hf_tokenizer.added_tokens_decoder.items() if t.special
        }
        self.special_token_ids = sorted(i for i in special if i < n)
        self.tokens = [
            hf_tokenizer.convert_ids_to_tokens(i).encode()
            if i in special
            else hf_tokenizer.decode([i]).encode()
            for i in range(n)
        ]
        # model rows past the tokenizer (and an end id there) decode to nothing: never text
        self.tokens += [f"<|unused_{i}|>".encode() for i in range(n, max(n_vocab, eos_id + 1))]
        self.special_token_ids += list(range(n, len(self.tokens)))

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """llguidance's view of one model's tokenizer, made once and shared by all requests."""

    def __init__(self, hf_tokenizer: Any, model_vocab: int, eos_id: int) -> None:
        self.vocab = model_vocab
        self.eos_id = eos_id
        self.ll_tokenizer = ll_tokenizer(hf_tokenizer, model_vocab, eos_id)
        self._lock = threading.Lock()

    def check(self, c: Constraint) -> None:
        """Raise `InvalidRequestError` (naming the field) if the grammar fails to compile for
        this tokenizer, e.g. an unsupported schema keyword or an empty language."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            c.grammar, self.ll_tokenizer
        )
        if is_error:
            raise InvalidRequestError(error_field(c), "; ".join(messages) or "invalid grammar")
        matcher = self.matcher(c)
        if matcher.is_error():
            raise InvalidRequestError(error_field(c), matcher.get_error())

    def matcher(self, c: Constraint) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.ll_tokenizer, c.grammar, log_level=0)
