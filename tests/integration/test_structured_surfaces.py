"""Structured output through every surface: the real proxy with the official `openai` client
(`response_format`, the client's `parse` helper with a pydantic model, the regex / choice /
grammar extensions), Triton gRPC and Triton HTTP (tiny random LLaDA: valid output by rule)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import proxy_fixtures
import pytest
from dlm_client import DLMClient
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration

proxy = proxy_fixtures.proxy
oai = proxy_fixtures.oai
model = proxy_fixtures.model

MSG = [{"role": "user", "content": "Describe a pet as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "legs", "kind"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str = Field(max_length=6)
    legs: int = Field(ge=0, le=8)
    kind: Literal["cat", "dog"]


def test_response_format_json_schema_via_openai(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.create(
        model=model,
        messages=MSG,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_parse_helper_with_pydantic_model(oai: openai.OpenAI, model: str) -> None:
    r = oai.chat.completions.parse(model=model, messages=MSG, max_tokens=64, response_format=Pet)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def test_extensions_via_openai_extra_body(oai: openai.OpenAI, model: str) -> None:
    r = oai.completions.create(
        model=model, prompt="Code:", max_tokens=16, extra_body={"regex": "[A-Z]{3}-[0-9]{2}"}
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", r.choices[0].text)
    r = oai.chat.completions.create(
        model=model, messages=MSG, max_tokens=16, extra_body={"choice": ["yes", "no"]}
    )
    assert r.choices[0].message.content in ("yes", "no")


def test_bad_schema_is_a_400_naming_the_field(oai: openai.OpenAI, model: str) -> None:
    bad = {"type": "integer", "minimum": 5, "maximum": 1}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model=model,
            messages=MSG,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
    assert "response_format.json_schema.schema" in str(err.value)


def test_triton_grpc_and_http(client: DLMClient) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    out = client.generate(messages=MSG, max_tokens=64, response_format=fmt)
    jsonschema.validate(json.loads(out.text), SCHEMA)
    out = client.generate_http(messages=MSG, max_tokens=24, grammar='start: "(" /[a-c]/ ")"')
    assert re.fullmatch(r"\([a-c]\)", out.text)
