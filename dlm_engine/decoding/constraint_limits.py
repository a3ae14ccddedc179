"""How large and how costly a structure constraint may be, checked before and while compiling.

A constraint is the client's program: a schema, regex or grammar that llguidance compiles and
then runs once per generated token. Three kinds of bound keep one request from harming the
server:

* **Shape limits, before compiling** (`check_value`, `check_schema`, `check_lark`,
  `check_choice`): JSON nesting depth, `$ref` count, grammar rules, choice entries. They are
  cheap, run on the raw value, and refuse what llguidance's recursive compiler or Python's own
  recursion (`json.dumps`, `repr`) could not take.
* **llguidance's own limits** (`PARSER_LIMITS`): lexer fuel, Earley items per step, lexer
  states, grammar size. A compile over them fails; a token step over them puts the matcher in
  an error state, which fails that request alone.
* **A measured budget** (`TOKEN_BUDGET_MS`, `STEP_BUDGET_MS`): the first tokens of a constraint
  are walked at validation and their thread CPU time taken; a constraint whose tokens cost more
  than the budget is refused up front (`structured.py`). A walk over the budget is repeated
  (timing noise only adds time), so a cheap constraint on a busy machine is not refused.

Every refusal is an `InvalidRequestError` naming the request field; llguidance's messages are cut
to their first line (no parser state).
"""

from __future__ import annotations

import os
import re
from typing import Any

import llguidance

from dlm_protocol.structure_shapes import MAX_NESTING, nesting_exceeds

from ..errors import InvalidRequestError

MAX_REFS = 256  # `$ref`s in one schema (a chain of them is compiled recursively)
MAX_GRAMMAR_RULES = 1000  # rules and terminals of one Lark / GBNF grammar
MAX_CHOICES = 1000  # entries of `choice` (llguidance's Earley rows hold 2000 items)
MAX_PATTERNS = 128  # `pattern`s in one schema (each is compiled and walked on its own)

# llguidance's defaults, tightened where one request could take a core or memory for long:
# initial lexer fuel bounds the regex size (`a{30000}` is over it), lexer states the memory of
# one matcher (~1-2 kB a state); the per-step fuels make a too-costly step an error of that row.
PARSER_LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=100_000,
    step_lexer_fuel=100_000,
    step_max_items=50_000,
    max_lexer_states=20_000,
    max_grammar_size=200_000,
    max_items_in_row=2000,
    verbose_errors=False,
)


def _env_ms(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# CPU time one constrained token may cost (its mask and consuming it), typically over the
# probe walk, and the same times the tokens a row commits in one step; over either the request
# is refused. JSON schemas cost tens of microseconds a token.
TOKEN_BUDGET_MS = _env_ms("DLM_CONSTRAINT_TOKEN_BUDGET_MS", 2.0)
STEP_BUDGET_MS = _env_ms("DLM_CONSTRAINT_STEP_BUDGET_MS", 16.0)
PROBE_TOKENS = 16  # tokens walked at validation
PROBE_WALKS = 3  # walks of those tokens at most; each token is judged by its cheapest walk
ONE_TOKEN_LIMIT = 25  # no single token of the walk may cost more than this many budgets


def check_value(field: str, value: Any) -> None:
    """A JSON value no deeper than `MAX_NESTING` (checked without recursion)."""
    if nesting_exceeds(value, MAX_NESTING):
        raise InvalidRequestError(field, f"nested more than {MAX_NESTING} levels deep")


def check_schema(field: str, schema: Any) -> None:
    """A JSON schema within the nesting and `$ref` limits."""
    check_value(field, schema)
    refs = sum(1 for _ in _values_of(schema, "$ref"))
    if refs > MAX_REFS:
        raise InvalidRequestError(field, f"has {refs} $ref entries; at most {MAX_REFS}")
    patterns = len(schema_patterns(schema))
    if patterns > MAX_PATTERNS:
        raise InvalidRequestError(field, f"has {patterns} patterns; at most {MAX_PATTERNS}")


def schema_patterns(schema: Any) -> tuple[str, ...]:
    """The regexes of a schema (`pattern`, `patternProperties`' keys), each compiled and walked
    on its own at validation: a walk of the whole schema may not reach them."""
    found = [v for v in _values_of(schema, "pattern") if isinstance(v, str)]
    for props in _values_of(schema, "patternProperties"):
        if isinstance(props, dict):
            found += list(props)
    return tuple(dict.fromkeys(found))


def _values_of(value: Any, key: str) -> list[Any]:
    """Every value under `key` in a nested JSON value (no recursion)."""
    found, todo = [], [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            if key in v:
                found.append(v[key])
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return found


# a rule or terminal definition: `name:`, `?name:`, `!name:`, `NAME.2:` at a line's start
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(\.-?\d+)?[ \t]*:", re.MULTILINE)


def check_lark(text: str) -> None:
    """A Lark or GBNF grammar of at most `MAX_GRAMMAR_RULES` definitions (checked before the
    GBNF conversion too, whose time grows with the square of the rules)."""
    rules = max(len(_LARK_RULE.findall(text)), text.count("::="))
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidRequestError(
            "grammar", f"has {rules} rules; at most {MAX_GRAMMAR_RULES} are allowed"
        )


def check_choice(value: list[str]) -> None:
    if len(value) > MAX_CHOICES:
        raise InvalidRequestError(
            "choice", f"has {len(value)} entries; at most {MAX_CHOICES} are allowed"
        )


def first_line(message: str) -> str:
    """llguidance's error without its parser state (the first line, at most 200 characters)."""
    line = message.strip().splitlines()[0] if message.strip() else "invalid constraint"
    return line.removesuffix("<non-verbose/>").strip()[:200]
