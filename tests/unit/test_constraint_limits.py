"""Hostile structure constraints: refused before any step with an error naming the field, never a
crash of the process; a constraint that still fails mid-generation fails its own row alone.

The crash case (a grammar deep enough to overflow llguidance's native stack) runs in a child
process, beside a control that shows the same grammar does crash an ordinary 8 MB thread.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from dlm_engine import Engine, EngineConfig, InvalidRequestError
from dlm_engine.decoding import constraint_limits, grammar
from dlm_engine.decoding.grammar import GrammarCompiler, parse_constraint
from dlm_lab.testing import make_tiny_checkpoint
from dlm_protocol.structure_shapes import MAX_NESTING, nesting_exceeds
from dlm_protocol.structure_shapes import response_format as response_format_shape


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("limits") / "llada", "llada", seed=1)
    return Engine(EngineConfig(model=str(ckpt), max_rows=8))


def _fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def _tool(parameters: dict) -> dict:
    fn = {"name": "f", "parameters": parameters}
    return dict(tools=[{"type": "function", "function": fn}], tool_choice="required")


def lark_chain(n: int) -> str:
    rules = "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "a"'


def ref_chain(n: int) -> dict:
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


RECURSIVE_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
COUNTED_PATTERN = {"type": "string", "pattern": "^(a{1000}){100}$"}

# (request keys, the field the error names, a word of the reason)
HOSTILE = {
    "lark_rule_chain": (dict(grammar=lark_chain(3500)), "grammar", "rules"),
    "gbnf_rule_chain": (
        dict(grammar="root ::= r0\n" + "\n".join(f'r{i} ::= "a"' for i in range(3500))),
        "grammar",
        "rules",
    ),
    "schema_ref_chain": (
        dict(response_format=_fmt(ref_chain(1000))),
        "response_format.json_schema.schema",
        "$ref",
    ),
    "tool_ref_chain": (_tool(ref_chain(1000)), "tools", "$ref"),
    "schema_nested_3000": (dict(response_format=_fmt(nested(3000))), "response_format", "nested"),
    "tool_nested_3000": (_tool(nested(3000)), "tools", "nested"),
    "regex_huge_count": (dict(regex="a{100000}"), "regex", "enforced"),
    "regex_nested_count": (dict(regex="(x{1000}){1000}"), "regex", "enforced"),
    "choice_2000": (dict(choice=[f"c{i}" for i in range(2000)]), "choice", "entries"),
    "schema_ref_root": (
        dict(response_format=_fmt({"$ref": "#"})),
        "response_format.json_schema.schema",
        "enforced",
    ),
    "schema_recursive_required": (
        dict(response_format=_fmt(RECURSIVE_REQUIRED)),
        "response_format.json_schema.schema",
        "enforced",
    ),
    "schema_counted_pattern": (
        dict(response_format=_fmt(COUNTED_PATTERN)),
        "response_format.json_schema.schema",
        "pattern",
    ),
    "tool_counted_pattern": (
        _tool({"type": "object", "properties": {"a": COUNTED_PATTERN}}),
        "tools",
        "pattern",
    ),
    "tool_recursive_required": (_tool(RECURSIVE_REQUIRED), "tools", "enforced"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_constraint_is_refused_naming_the_field(engine: Engine, name: str) -> None:
    params, field, word = HOSTILE[name]
    with pytest.raises(InvalidRequestError) as err:
        engine.resolve_params(params)
    assert err.value.field == field
    assert word in err.value.reason
    assert "\n" not in err.value.reason and "<state>" not in err.value.reason  # no parser dump
    # the engine still serves a constrained request afterwards
    out = engine.generate([[5, 6, 7]], dict(max_tokens=8, regex="[a-z]{2,5}"))[0]
    assert out.finish_reason == "stop" and out.error is None


GOOD = {
    "json_object": dict(response_format={"type": "json_object"}),
    "regex": dict(regex="a{1000}"),
    "choice_1000": dict(choice=[f"option {i}" for i in range(1000)]),
    "schema_refs": dict(response_format=_fmt(ref_chain(200))),
    "schema_nested": dict(response_format=_fmt(nested(20))),
    "lark": dict(grammar=lark_chain(900)),
    "tool": _tool({"type": "object", "properties": {"d": {"type": "string", "pattern": "^x+$"}}}),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_large_but_reasonable_constraints_are_accepted(engine: Engine, name: str) -> None:
    assert engine.resolve_params(GOOD[name]).constraint is not None


def test_deep_grammar_compiles_on_the_guarded_thread_and_crashes_a_plain_one(
    engine: Engine,
) -> None:
    """The grammar that overflowed the model process's stack compiles on the guarded thread;
    the same compile on an ordinary 8 MB thread is a segfault (so the guard is what saves it)."""
    code = textwrap.dedent(
        f"""
        import sys, threading, llguidance
        from transformers import AutoTokenizer
        from dlm_engine.decoding import guarded
        from dlm_engine.decoding.grammar import ll_tokenizer
        hf = AutoTokenizer.from_pretrained(sys.argv[2])
        tok = ll_tokenizer(hf, len(hf), hf.eos_token_id or 0)
        g = llguidance.LLMatcher.grammar_from_lark({lark_chain(3500)!r})
        compile = lambda: llguidance.LLMatcher(tok, g, log_level=0).is_error()
        if sys.argv[1] == "guarded":
            print("error" if guarded.run(compile) else "compiled")
        else:
            threading.stack_size(8 << 20)
            t = threading.Thread(target=compile)
            t.start(); t.join()
            print("compiled")
        """
    )
    root = Path(__file__).resolve().parents[2]

    def child(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code, mode, engine.config.model],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )

    guarded_run = child("guarded")
    assert guarded_run.returncode == 0, guarded_run.stderr[-2000:]
    assert guarded_run.stdout.split()[-1] == "compiled", guarded_run.stdout
    plain = child("plain")
    assert plain.returncode < 0, plain.stdout  # killed by a signal: the crash the guard avoids


def test_a_constraint_that_fails_mid_generation_fails_its_row_alone(engine: Engine) -> None:
    """Twenty free choices carry the walk at validation past its end; the 2,100 alternatives
    after them then exceed llguidance's Earley row limit mid-generation: that row ends with a
    clean error naming the field, its neighbour's tokens equal the neighbour's alone."""
    alternatives = " | ".join(f'"b{i}"' for i in range(2100))
    late = dict(max_tokens=32, steps=32, grammar=f'start: ("a" | "b")~20 c\nc: {alternatives}')
    assert engine.resolve_params(late).constraint is not None  # not seen at validation
    prompt = [5, 6, 7]
    plain = dict(max_tokens=16, steps=16)
    alone = engine.generate([prompt], plain)[0]
    failed, neighbour = engine.generate([prompt, prompt], [late, plain])
    assert failed.finish_reason == "error"
    assert failed.error.startswith("invalid request: grammar: the constraint could not be")
    assert "\n" not in failed.error and "<state>" not in failed.error
    assert set(failed.text) <= {"a", "b"} and len(failed.text) < 20  # what came before stands
    assert neighbour.error is None and neighbour.token_ids == alone.token_ids


def test_too_costly_per_token_is_refused(engine: Engine, monkeypatch) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.model_vocab, engine.loaded.eos_id)
    c = parse_constraint({"regex": "[a-z]{3,9}"})
    assert compiler.check(c).token_ms < constraint_limits.TOKEN_BUDGET_MS
    monkeypatch.setattr(constraint_limits, "TOKEN_BUDGET_MS", 1e-9)
    fresh = GrammarCompiler(engine.tokenizer, engine.runner.model_vocab, engine.loaded.eos_id)
    with pytest.raises(InvalidRequestError, match="ms of CPU a token") as err:
        fresh.check(c)
    assert err.value.field == "regex"


def test_too_costly_per_step_is_refused(engine: Engine, monkeypatch) -> None:
    monkeypatch.setattr(constraint_limits, "STEP_BUDGET_MS", 1e-9)
    fresh = GrammarCompiler(engine.tokenizer, engine.runner.model_vocab, engine.loaded.eos_id)
    c = parse_constraint({"regex": "[a-z]{3,9}"})
    fresh.check(c, tokens_per_step=1)  # one token a step: only the per-token budget applies
    with pytest.raises(InvalidRequestError, match="a step") as err:
        fresh.check(c, tokens_per_step=32)
    assert err.value.field == "regex"


def test_a_grammar_compiles_once_and_rows_get_copies(engine: Engine) -> None:
    compiler = GrammarCompiler(engine.tokenizer, engine.runner.model_vocab, engine.loaded.eos_id)
    c = parse_constraint({"regex": "[0-9]{4}"})
    first = compiler.compiled(c)
    assert compiler.compiled(c) is first  # the n requests of a fan-out share one compile
    a, b = compiler.matcher(c), compiler.matcher(c)
    assert a is not first.matcher and b is not a
    digit = engine.tokenizer.encode("7", add_special_tokens=False)[0]
    assert a.consume_token(digit)
    assert b.validate_tokens([digit] * 5) == 4  # b did not see a's token
    bad = parse_constraint({"regex": "a{100000}"})
    with pytest.raises(InvalidRequestError):
        compiler.compiled(bad)
    assert isinstance(compiler._cache[bad.grammar], InvalidRequestError)  # refusals kept too


def test_nesting_is_checked_without_recursion() -> None:
    deep: list = []
    for _ in range(100_000):  # far beyond Python's recursion limit
        deep = [deep]
    assert nesting_exceeds(deep)
    assert not nesting_exceeds(nested(20))
    assert nesting_exceeds({"a": nested(MAX_NESTING)})
    text = '{"type": "json_schema", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    assert "nested" in response_format_shape(text)
    with pytest.raises(InvalidRequestError) as err:
        grammar.parse_constraint({"choice": deep})
    assert err.value.field == "choice"


def test_tokens_per_step(engine: Engine) -> None:
    from dlm_engine.decoding.structured import tokens_per_step

    p = engine.resolve_params(dict(max_tokens=32, steps=8, block_length=32))
    assert tokens_per_step(p) == 4
    assert tokens_per_step(replace(p, threshold=0.9)) == 32


class _Clock:
    """thread_time() for the probe: token i of walk w costs `walks[w][i]` seconds (the last
    walk's costs repeat for any later walk)."""

    def __init__(self, walks: list[list[float]]) -> None:
        self.walks, self.walk, self.now, self.calls = walks, -1, 0.0, 0

    def start_walk(self) -> None:
        self.walk, self.calls = self.walk + 1, 0

    def __call__(self) -> float:
        if self.calls % 2:  # the second read of a token: its cost has passed
            costs = self.walks[min(self.walk, len(self.walks) - 1)]
            self.now += costs[min(self.calls // 2, len(costs) - 1)]
        self.calls += 1
        return self.now


CHEAP = [0.05] * 16
SPIKE = [0.05] * 8 + [60.0] + [0.05] * 7


@pytest.mark.parametrize(
    ("walks_ms", "accepted"),
    [
        ([[30.0] + [0.05] * 15], True),  # a first mask that builds lexer states, then cheap
        ([[3.0] * 16], False),  # every token over the 2 ms budget, on every walk
        ([SPIKE], False),  # one token over 25 budgets, on every walk
        ([[3.0] * 16, CHEAP], True),  # a busy machine's first walk; the second is cheap
        ([SPIKE, CHEAP], True),  # one token slowed once by noise
        ([[3.0] * 16, [3.0] * 16, CHEAP], True),  # the third walk is the last one taken
        ([[3.0] * 16, [3.0] * 16, [3.0] * 16, CHEAP], False),  # over on all three walks
    ],
)
def test_the_walk_judges_the_typical_token(
    engine: Engine, monkeypatch, walks_ms: list[list[float]], accepted: bool
) -> None:
    fresh = GrammarCompiler(engine.tokenizer, engine.runner.model_vocab, engine.loaded.eos_id)
    clock = _Clock([[c / 1e3 for c in walk] for walk in walks_ms])
    monkeypatch.setattr(grammar.time, "thread_time", clock)
    walk = GrammarCompiler._walk

    def timed_walk(self, *args):
        clock.start_walk()
        return walk(self, *args)

    monkeypatch.setattr(GrammarCompiler, "_walk", timed_walk)
    c = parse_constraint({"regex": "[a-z]{20}"})  # 16 tokens to walk
    if accepted:
        assert fresh.check(c).token_ms == pytest.approx(0.05)
        assert clock.walk + 1 == len(walks_ms)  # no walk after the first one within budget
    else:
        with pytest.raises(InvalidRequestError, match="ms of CPU a token"):
            fresh.check(c)
        assert clock.walk + 1 == constraint_limits.PROBE_WALKS  # refused only after every walk
