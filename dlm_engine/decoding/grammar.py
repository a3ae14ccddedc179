"""Compiling a request's structure constraint (JSON schema, regex, choice, Lark/GBNF) with
llguidance, per tokenizer.

The grammar engine is llguidance (a maintained Earley-based matcher that computes token masks);
nothing here parses JSON schemas or regexes itself. `compile_constraint` turns the request's
`response_format` / `regex` / `choice` / `grammar` value into one llguidance grammar, checks it
against the model's tokenizer and raises `InvalidRequestError` naming the field on anything
unsupported or unsatisfiable.

Compiling is bounded (`constraint_limits.py`): shape limits before llguidance sees the value,
llguidance's own limits, and a measured per-token cost; the compile itself runs on a thread with
a large stack (`guarded.py`), so no grammar can overflow the native stack of the model process.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from ..errors import InvalidRequestError
from . import constraint_limits as limits
from . import guarded

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
    patterns: tuple[str, ...] = ()  # the schema's regexes, walked on their own at validation


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
    limits.check_value(key, value)  # before json.dumps, which recurses
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
    limits.check_lark(text)
    try:
        lark = any_to_lark(text)
    except Exception as exc:
        raise InvalidRequestError("grammar", f"cannot read as Lark or GBNF: {exc}") from None
    limits.check_lark(lark)
    return lark


def _choice(value: Any) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequestError("choice", "must be a non-empty list of non-empty strings")
    limits.check_choice(value)
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
    limits.check_schema(f"{field}.json_schema.schema", schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    except Exception as exc:
        raise InvalidRequestError(f"{field}.json_schema.schema", str(exc)) from None
    return Constraint(field, "json_schema", grammar, schema, limits.schema_patterns(schema))


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


@dataclass(frozen=True)
class Compiled:
    """A grammar compiled for one tokenizer: its pristine matcher (rows get copies) and the
    typical CPU time a token cost on the probe walk."""

    matcher: llguidance.LLMatcher
    token_ms: float


def _typical_over_budget(costs: list[float]) -> bool:
    return statistics.median_low(costs) * 1e3 > limits.TOKEN_BUDGET_MS


def _cheapest(best: list[float], costs: list[float]) -> list[float]:
    """Each token's cheapest time over two walks (a walk stopped early is shorter)."""
    return [
        min(walk[i] for walk in (best, costs) if i < len(walk))
        for i in range(max(len(best), len(costs)))
    ]


def _over_budget(costs: list[float]) -> bool:
    """The typical token over the budget, or one token over `ONE_TOKEN_LIMIT` budgets."""
    if not costs:
        return False
    worst_ms = max(costs) * 1e3
    return _typical_over_budget(costs) or worst_ms > limits.TOKEN_BUDGET_MS * limits.ONE_TOKEN_LIMIT


class GrammarCompiler:
    """llguidance's view of one model's tokenizer, made once and shared by all requests.

    Compiled grammars (and refusals) are kept by grammar text: the `n` requests of a fan-out,
    and a request's check and its row, compile once."""

    CACHE = 64

    def __init__(self, hf_tokenizer: Any, model_vocab: int, eos_id: int) -> None:
        self.vocab = model_vocab
        self.eos_id = eos_id
        self.ll_tokenizer = ll_tokenizer(hf_tokenizer, model_vocab, eos_id)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Compiled | InvalidRequestError] = OrderedDict()

    def check(self, c: Constraint, tokens_per_step: int = 1) -> Compiled:
        """The compiled grammar; raises `InvalidRequestError` naming the field if it fails to
        compile for this tokenizer (an unsupported schema keyword, an empty language, a limit),
        fails on its first tokens, or costs more CPU a token (times `tokens_per_step`) than
        the budget."""
        compiled = self.compiled(c)
        step_ms = compiled.token_ms * tokens_per_step
        if tokens_per_step > 1 and step_ms > limits.STEP_BUDGET_MS:
            raise InvalidRequestError(
                error_field(c),
                f"costs {compiled.token_ms:.2f} ms of CPU a token to enforce; at "
                f"{tokens_per_step} tokens a step that is {step_ms:.1f} ms, over this "
                f"server's budget of {limits.STEP_BUDGET_MS:g} ms a step: use more steps, "
                "no threshold, or a simpler constraint",
            )
        return compiled

    def compiled(self, c: Constraint) -> Compiled:
        with self._lock:
            found = self._cache.get(c.grammar)
            if found is not None:
                self._cache.move_to_end(c.grammar)
        if found is None:
            try:
                found = guarded.run(self._compile, c)
            except InvalidRequestError as exc:
                found = exc
            with self._lock:
                self._cache[c.grammar] = found
                while len(self._cache) > self.CACHE:
                    self._cache.popitem(last=False)
        if isinstance(found, InvalidRequestError):
            raise InvalidRequestError(found.field, found.reason)
        return found

    def matcher(self, c: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher for one row (a copy of the compiled one: microseconds)."""
        return self.compiled(c).matcher.deep_copy()

    def _compile(self, c: Constraint) -> Compiled:
        """Compile and walk the first tokens (on a guarded thread)."""
        field = error_field(c)
        matcher = llguidance.LLMatcher(
            self.ll_tokenizer, c.grammar, log_level=0, limits=limits.PARSER_LIMITS
        )
        if matcher.is_error():
            raise InvalidRequestError(field, limits.first_line(matcher.get_error()))
        for pattern in c.patterns:
            self._check_pattern(field, pattern)
        return Compiled(matcher, self._probe(field, matcher))  # walks copies of it

    def _check_pattern(self, field: str, pattern: str) -> None:
        """One `pattern` of the schema as a JSON string of its own: compiled and walked (its
        lexer is built on its first mask, where the whole schema's walk may never go)."""
        schema = {"type": "string", "pattern": pattern}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        matcher = llguidance.LLMatcher(
            self.ll_tokenizer, grammar, log_level=0, limits=limits.PARSER_LIMITS
        )
        try:
            if matcher.is_error():
                raise InvalidRequestError(field, limits.first_line(matcher.get_error()))
            self._probe(field, matcher)
        except InvalidRequestError as exc:
            raise InvalidRequestError(field, f"pattern {pattern[:60]!r}: {exc.reason}") from None

    def _probe(self, field: str, matcher: llguidance.LLMatcher) -> float:
        """Judge the constraint's CPU cost a token on up to `PROBE_WALKS` walks of the same
        tokens; raise on a failure, when the typical token (the lower median: the first mask
        also builds lexer states once) is over the budget, or when one token is over
        `ONE_TOKEN_LIMIT` budgets. Returns the typical token's cost in ms.

        Timing noise only ever adds time (another process on the core, a hypervisor's stolen
        time counted as the thread's), so a walk judged over the budget is walked again on a
        fresh copy and each token keeps its cheapest time: a costly constraint is costly on
        every walk, a cheap one measured on a busy machine is not refused for the noise."""
        best: list[float] = []
        for _ in range(limits.PROBE_WALKS):
            costs = self._walk(field, matcher.deep_copy())
            best = _cheapest(best, costs)
            if not _over_budget(best):
                break
        typical_ms = statistics.median_low(best) * 1e3 if best else 0.0
        worst_ms = max(best, default=0.0) * 1e3
        if _over_budget(best):
            raise InvalidRequestError(
                field,
                f"costs {max(typical_ms, worst_ms / limits.ONE_TOKEN_LIMIT):.1f} ms of CPU a "
                f"token to enforce, over this server's budget of {limits.TOKEN_BUDGET_MS:g} ms: "
                "simplify it (smaller counted repetitions, fewer alternatives or rules)",
            )
        return typical_ms

    def _walk(self, field: str, matcher: llguidance.LLMatcher) -> list[float]:
        """Walk up to `PROBE_TOKENS` tokens (random allowed ones, fixed seed: every walk takes
        the same path), timing each mask and consume in thread CPU time (a busy machine's
        waits do not count); stop early once the typical token is over the budget. Raises
        when the constraint fails on these tokens."""
        rng = random.Random(0)
        bitmask = llnp.allocate_token_bitmask(1, self.ll_tokenizer.vocab_size)
        costs: list[float] = []
        for _ in range(limits.PROBE_TOKENS):
            t0 = time.thread_time()
            llnp.fill_next_token_bitmask(matcher, bitmask, 0)
            if matcher.is_error():
                break
            allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
            allowed = allowed[(allowed != self.eos_id) & (allowed < self.vocab)]
            if len(allowed):
                matcher.consume_token(int(rng.choice(allowed)))
            costs.append(time.thread_time() - t0)
            over = len(costs) >= 3 and _typical_over_budget(costs)
            if not len(allowed) or matcher.is_error() or over:
                break  # the end, a failure, or already over the budget: walk no further
        if matcher.is_error():
            raise InvalidRequestError(
                field, f"cannot be enforced: {limits.first_line(matcher.get_error())}"
            )
        return costs
