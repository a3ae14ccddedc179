"""DiffusionGemma structured output and required tool calls (decoding/uniform_constraints.py).

There is no upstream to match for a constrained canvas, so these tests prove validity: with
random weights every answer parses and validates against its schema, regex, choice or grammar
across seeds, and a constrained row batched with unconstrained rows leaves their tokens those
of the sampler alone (which tests/unit/test_diffusion_gemma.py pins to transformers).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_cases import CHOICES, GBNF, GBNF_CHECK, LARK, LARK_CHECK, REGEXES, SCHEMAS

from dlm_engine.decoding.uniform_diffusion import generate
from dlm_lab.testing_diffusion_gemma import generation_settings, make_tiny_diffusion_gemma

pytest.importorskip("transformers")

CANVAS = 16
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dlm_engine import Engine, EngineConfig

    ckpt = make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg"), canvas_length=CANVAS)
    return Engine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_rows=32))


def _prompt(engine, text: str) -> list[int]:
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def test_every_schema_answer_validates_across_seeds(engine):
    """All schemas of the shared cases, three seeds each, in one batch: each answer ends with
    a stop (never cut by max_tokens) and validates against its schema."""
    cases = [(name, seed) for name in SCHEMAS for seed in SEEDS]
    prompt = _prompt(engine, "Answer in JSON.")
    params = [
        {"seed": seed, "max_tokens": 96, "response_format": _format(SCHEMAS[name])}
        for name, seed in cases
    ]
    outs = engine.generate([prompt] * len(cases), params)
    for (name, seed), out in zip(cases, outs, strict=True):
        assert out.error is None, (name, seed, out.error)
        assert out.finish_reason == "stop", (name, seed, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_json_object_regex_choice_and_grammars_hold(engine):
    prompt = _prompt(engine, "Answer.")
    cases: list[tuple[dict, object]] = [({"response_format": {"type": "json_object"}}, dict)]
    cases += [({"regex": r}, re.compile(r)) for r in REGEXES]
    cases += [({"choice": c}, set(c)) for c in CHOICES]
    cases += [
        ({"grammar": LARK}, re.compile(LARK_CHECK)),
        ({"grammar": GBNF}, re.compile(GBNF_CHECK)),
    ]
    runs = [(keys, check, seed) for keys, check in cases for seed in SEEDS]
    outs = engine.generate(
        [prompt] * len(runs), [keys | {"seed": seed, "max_tokens": 48} for keys, _, seed in runs]
    )
    for (keys, check, seed), out in zip(runs, outs, strict=True):
        assert out.error is None and out.finish_reason == "stop", (keys, seed, out.text)
        if check is dict:
            assert isinstance(json.loads(out.text), dict)
        elif isinstance(check, set):
            assert out.text in check
        else:
            assert check.fullmatch(out.text), (keys, seed, out.text)


def _alone(engine, prompt: list[int], seed: int, max_tokens: int) -> list[int]:
    """The sampler run alone, cut as served text is (first stop excluded, max_tokens)."""
    settings = generation_settings(engine.loaded.path, max_tokens, CANVAS)
    tokens = generate(engine.loaded.model, [prompt], [settings], [seed], sorted(engine.stop_ids))
    tokens = tokens[0][:max_tokens]
    stops = [i for i, t in enumerate(tokens) if t in engine.stop_ids]
    return tokens[: stops[0]] if stops else tokens


def test_constrained_row_leaves_its_neighbours_unchanged(engine):
    plain = [(_prompt(engine, "hi there"), 1, 40), (_prompt(engine, "sort 4 2 9"), 6, 48)]
    constrained = {"seed": 1, "max_tokens": 48, "response_format": _format(SCHEMAS["flat"])}
    prompts = [plain[0][0], _prompt(engine, "hi there"), plain[1][0]]
    params = [
        {"seed": 1, "max_tokens": 40},
        constrained,
        {"seed": 6, "max_tokens": 48},
    ]
    outs = engine.generate(prompts, params)
    for (prompt, seed, max_tokens), out in zip(plain, (outs[0], outs[2]), strict=True):
        assert out.token_ids == _alone(engine, prompt, seed, max_tokens)
    jsonschema.validate(json.loads(outs[1].text), SCHEMAS["flat"])
    # the same seed unconstrained is not JSON: the constraint did the work
    free = engine.generate([prompts[1]], {"seed": 1, "max_tokens": 48})[0]
    assert free.text != outs[1].text


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=str
)
def test_required_and_named_tool_calls_are_valid_calls(engine, choice):
    prompt = engine.encode_prompt(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=engine.resolve_params({"tools": TOOLS, "tool_choice": choice}).tools,
    )
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    keys = {"tools": TOOLS, "tool_choice": choice, "max_tokens": 96}
    outs = engine.generate([prompt] * len(SEEDS), [keys | {"seed": s} for s in SEEDS])
    for out in outs:
        assert out.error is None and out.finish_reason == "tool_calls", out.text
        assert out.text == ""  # no markup is content
        assert out.tool_calls
        for call in out.tool_calls:
            name = call["function"]["name"]
            if isinstance(choice, dict):
                assert name == "add"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_a_matcher_failure_ends_its_row_alone(engine, monkeypatch):
    """A row whose matcher fails mid-canvas ends with the constraint's error; its neighbour
    finishes as it would alone."""
    from dlm_engine.decoding import uniform_constraints

    prompt = _prompt(engine, "hi there")
    real = uniform_constraints.CanvasConstraint.allowed

    def failing(self, vocab, device):
        self.constraint.matcher.consume_token(10**6)  # an id beyond the vocabulary: error
        return real(self, vocab, device)

    monkeypatch.setattr(uniform_constraints.CanvasConstraint, "allowed", failing)
    outs = engine.generate(
        [prompt, prompt],
        [{"seed": 1, "max_tokens": 40}, {"seed": 2, "max_tokens": 40, "regex": "[a-z]+"}],
    )
    assert outs[0].token_ids == _alone(engine, prompt, 1, 40)
    assert outs[1].error and "regex" in outs[1].error
