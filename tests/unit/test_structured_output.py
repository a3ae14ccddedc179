"""Structured output: every finished answer parses and validates, whatever the model knows.

Random-weight LLaDA and Dream layouts know nothing, so anything valid they produce comes from
the grammar rule (docs/architecture.md, "Structured output"); tiny-dlm also gets the content
right. Rows without a constraint are unchanged by constrained neighbours.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from structured_cases import CHOICES, GBNF, GBNF_CHECK, LARK, LARK_CHECK, REGEXES, SCHEMAS

from dlm_engine import Engine, EngineConfig, InvalidRequestError
from dlm_lab.training import tasks

ASSET = Path(__file__).resolve().parents[2] / "dlm_engine" / "assets" / "tiny-dlm"


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def _prompt(eng: Engine) -> list[int]:
    return eng.encode_prompt(messages=[{"role": "user", "content": "Answer in the format."}])


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_every_schema_validates_on_a_random_model(engines: dict[str, Engine], family: str) -> None:
    eng = engines[family]
    names = list(SCHEMAS)
    params = [
        dict(max_tokens=96, response_format=_schema_format(SCHEMAS[n]), seed=i, temperature=0.0)
        for i, n in enumerate(names)
    ]
    params.append(dict(max_tokens=64, response_format={"type": "json_object"}))
    outs = eng.generate([_prompt(eng)] * len(params), params)
    for name, out in zip([*names, "json_object"], outs, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        value = json.loads(out.text)
        if name == "json_object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, SCHEMAS[name])


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_regex_choice_and_grammars_on_a_random_model(
    engines: dict[str, Engine], family: str
) -> None:
    eng = engines[family]
    cases: list[tuple[dict, object]] = [(dict(regex=r), r) for r in REGEXES]
    cases += [(dict(choice=c), c) for c in CHOICES]
    cases += [(dict(grammar=LARK), LARK_CHECK), (dict(grammar=GBNF), GBNF_CHECK)]
    params = [dict(max_tokens=32, steps=16, **c) for c, _ in cases]
    params[0]["temperature"] = 1.0  # sampled rows obey the grammar too
    params[0]["seed"] = 3
    outs = eng.generate([_prompt(eng)] * len(params), params)
    for (_, check), out in zip(cases, outs, strict=True):
        assert out.finish_reason == "stop", (check, out.text)
        if isinstance(check, list):
            assert out.text in check
        else:
            assert re.fullmatch(check, out.text), (check, out.text)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_threshold_and_blocks_keep_the_guarantee(engines: dict[str, Engine], family: str) -> None:
    eng = engines[family]
    fmt = _schema_format(SCHEMAS["nested"])
    params = [
        dict(max_tokens=64, threshold=0.5, response_format=fmt),
        dict(max_tokens=64, steps=8, response_format=fmt),
    ]
    if family == "llada":
        params.append(dict(max_tokens=64, steps=16, block_length=16, response_format=fmt))
    for out in eng.generate([_prompt(eng)] * len(params), params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS["nested"])


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_unconstrained_row_unchanged_by_constrained_neighbours(
    engines: dict[str, Engine], family: str
) -> None:
    eng = engines[family]
    p = _prompt(eng)
    plain = [dict(max_tokens=32, steps=16), dict(max_tokens=32, steps=32, temperature=0.7, seed=5)]
    alone = eng.generate([p, p], plain)
    mixed = eng.generate(
        [p] * 4,
        [
            dict(max_tokens=32, steps=16, response_format={"type": "json_object"}),
            plain[0],
            dict(max_tokens=32, steps=32, regex="[a-z]{3,9}"),
            plain[1],
        ],
    )
    assert [mixed[1].token_ids, mixed[3].token_ids] == [alone[0].token_ids, alone[1].token_ids]


def test_too_short_canvas_ends_with_length(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    out = eng.generate([_prompt(eng)], dict(max_tokens=6, regex="[a-z]{10}"))[0]
    assert out.finish_reason == "length"
    assert re.fullmatch("[a-z]{6}", out.text)


BAD = [
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (
        dict(response_format=_schema_format({"type": "integer", "minimum": 5, "maximum": 1})),
        "response_format.json_schema.schema",
    ),
    (
        dict(
            response_format=_schema_format({"type": "object", "properties": {"a": {"type": "x"}}})
        ),
        "response_format.json_schema.schema",
    ),
    (
        dict(response_format=_schema_format({"$ref": "#/nowhere"})),
        "response_format.json_schema.schema",
    ),
    (dict(regex="([a-z"), "regex"),
    (dict(regex=""), "regex"),
    (dict(choice=[]), "choice"),
    (dict(choice="yes"), "choice"),
    (dict(grammar="start: undefined_rule"), "grammar"),
    (dict(regex="a", choice=["a"]), "choice"),
]


@pytest.mark.parametrize(("params", "field"), BAD)
def test_bad_constraints_name_the_field(
    engines: dict[str, Engine], params: dict, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["llada"].resolve_params(params)
    assert err.value.field == field


def test_tiny_dlm_answers_right_under_a_constraint() -> None:
    """The trained model keeps its answers when its output is constrained to a number."""
    eng = Engine(EngineConfig(model=str(ASSET), max_rows=8))
    examples = [e for e in tasks.heldout_examples(40) if e.task in ("add", "sub")][:6]
    prompts = [eng.encode_prompt(messages=tasks.messages_for(e)) for e in examples]
    number = dict(max_tokens=16, steps=16, regex="-?[0-9]{1,4}")
    outs = eng.generate(prompts, number)
    right = sum(o.text == e.answer for o, e in zip(outs, examples, strict=True))
    assert all(o.finish_reason == "stop" for o in outs)
    assert right >= 5, [(e.answer, o.text) for o, e in zip(outs, examples, strict=True)]
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    out = eng.generate(
        prompts[:1], dict(max_tokens=24, steps=24, response_format=_schema_format(schema))
    )[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
