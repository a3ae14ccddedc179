"""DiffusionGemma's constrained canvases (decoding/uniform_constraints.py) served by the real
tritonserver behind the OpenAI proxy, through the `openai` client: every seed's json_schema
answer validates, and a required tool call comes back as an OpenAI tool call whose arguments
validate, with no markup in the content."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from proxy_fixtures import ProxyProcess

from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def dg_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / "tiny-dg", canvas_length=16)


def test_json_schema_and_required_tool_calls_through_the_proxy(
    server_factory, dg_checkpoint, tmp_path
):
    server = server_factory(dg_checkpoint, name="tiny-diffusiongemma")
    proxy = ProxyProcess([server.urls["grpc"]], log_path=tmp_path / "proxy.log").start()
    try:
        client = proxy.client()
        for seed in (0, 1, 2):
            got = client.chat.completions.create(
                model=server.model_name,
                messages=[{"role": "user", "content": "A person as JSON."}],
                max_tokens=96,
                seed=seed,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
                },
            )
            assert got.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
            call = client.chat.completions.create(
                model=server.model_name,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                max_tokens=128,
                seed=seed,
                tools=TOOLS,
                tool_choice="required",
            )
            choice = call.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert not choice.message.content  # no markup is content
            assert choice.message.tool_calls
            for tc in choice.message.tool_calls:
                assert tc.function.name == "get_weather"
                jsonschema.validate(json.loads(tc.function.arguments), WEATHER)
    finally:
        proxy.stop()
