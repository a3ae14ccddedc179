"""The request contract (dlm_protocol) and the places that must follow it: engine, proxy
schema, adapter tensors, model repository, client, CLI, config defaults and docs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from dlm_engine import Engine, EngineConfig, InvalidRequestError, SamplingParams
from dlm_protocol import ALIASES, PARAM_NAMES, PARAMS, docgen, limits, parse_params, tensors
from dlm_protocol.params import BLOCK_DIFFUSION_ONLY, UNIFORM_ONLY
from dlm_protocol.settings import BY_NAME as SETTINGS
from dlm_triton.backend.settings import resolve_settings
from dlm_triton.launch import cli, model_repo
from openai_proxy.config import ProxyConfig
from openai_proxy.schemas import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("param", PARAMS, ids=PARAM_NAMES)
def test_every_key_has_a_valid_and_an_invalid_example(param) -> None:
    valid, invalid = param.examples
    assert valid is not None and invalid is not None, "add examples to the Param"
    param.check(valid)
    with pytest.raises(InvalidRequestError) as err:
        param.check(invalid)
    assert err.value.field == param.name
    assert str(err.value).startswith(f"invalid request: {param.name}: ")


# Strings are never numbers or booleans, booleans never numbers, floats never integers.
STRICT = [
    ("steps", "8"),
    ("steps", True),
    ("steps", 8.0),
    ("temperature", "0.5"),
    ("temperature", False),
    ("temperature", float("nan")),
    ("suppress_eos", "true"),
    ("suppress_eos", 1),
    ("algorithm", 3),
    ("stop", [1]),
    ("seed", "7"),
]


@pytest.mark.parametrize(("key", "value"), STRICT, ids=[f"{k}={v!r}" for k, v in STRICT])
def test_types_are_strict_everywhere(key: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_params({key: value})
    assert err.value.field == key
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict({key: value})
    assert err.value.field == key
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, key: value})
    assert info.value.errors()[0]["loc"][0] == key


def test_aliases_resolve_and_conflicts_name_the_key() -> None:
    assert parse_params({"gen_length": 16, "num_denoising_steps": 8, "remasking": "random"}) == {
        "max_tokens": 16,
        "steps": 8,
        "algorithm": "random",
    }
    assert parse_params({"stream_mode": "block_append"}) == {"stream_mode": "delta"}
    assert parse_params({"steps": 4, "diffusion_steps": 4}) == {"steps": 4}
    with pytest.raises(InvalidRequestError) as err:
        parse_params({"steps": 4, "diffusion_steps": 8})
    assert err.value.field == "steps"
    with pytest.raises(InvalidRequestError) as err:
        parse_params({"temprature": 1})
    assert err.value.field == "temprature" and "unknown" in err.value.reason
    assert parse_params({"top_k": None}) == {}
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict({"self": 1})  # any key is data, never a Python argument
    assert err.value.field == "self"


def test_engine_sampling_params_are_the_contract_keys() -> None:
    p = SamplingParams()
    assert set(p.to_dict()) == set(PARAM_NAMES)
    for param in PARAMS:
        default = list(param.default) if isinstance(param.default, tuple) else param.default
        assert getattr(p, param.name) == default, param.name
    assert SamplingParams(gen_length=8).max_tokens == 8


def test_engine_accepts_every_valid_example(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    for param in PARAMS:
        request = {"max_tokens": 8, param.name: param.examples[0]}
        # accepted by SDAR/LLaDA2 (DiffusionGemma) engines only
        if param.name in BLOCK_DIFFUSION_ONLY + UNIFORM_ONLY:
            with pytest.raises(InvalidRequestError) as err:
                eng.resolve_params(request)
            assert err.value.field == param.name
            continue
        resolved = eng.resolve_params(request)
        assert resolved.max_tokens in (8, 16)


def test_proxy_schema_has_every_key_and_alias() -> None:
    for alias, name in ALIASES.items():
        if alias == "max_completion_tokens":  # OpenAI's own field on chat, same check
            continue
        param = next(p for p in PARAMS if p.name == name)
        if name == "logprobs":  # chat's is OpenAI's boolean; completions' is the count
            req = CompletionRequest.model_validate(
                {"model": "m", "prompt": "p", alias: param.examples[0]}
            )
            assert req.logprobs == param.check(param.examples[0])
            continue
        req = ChatCompletionRequest.model_validate({**CHAT, alias: param.examples[0]})
        assert getattr(req, name) == param.check(param.examples[0]), alias
    props = ChatCompletionRequest.model_json_schema()["properties"]
    for param in PARAMS:
        assert props[param.name]["description"], param.name


def test_stream_and_n_are_strict_openai_types() -> None:
    for body, field in (
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"n": "2"}, "n"),
        ({"n": 2.0}, "n"),
        ({"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options"),
        ({"model": 5}, "model"),
        ({"max_completion_tokens": "5"}, "max_completion_tokens"),
    ):
        with pytest.raises(ValidationError) as info:
            ChatCompletionRequest.model_validate({**CHAT, **body})
        assert info.value.errors()[0]["loc"][0] == field, body


def test_tensors_are_written_from_the_contract() -> None:
    config = model_repo.render_config(model_repo.MODELS[0], "KIND_CPU")
    for t in (*tensors.INPUTS, *tensors.OUTPUTS):
        assert f'name: "{t.name}" data_type: {t.config_type}' in config, t.name
    assert model_repo.diff_repository() == [], "run python -m dlm_triton.launch.model_repo"
    from dlm_client import client

    assert client.OUTPUTS == tensors.OUTPUT_NAMES
    arrays = client.build_inputs("x", stream=True, sampling={"steps": 2}, input_ids=[1])
    for name, array in arrays.items():
        assert array.dtype.name == tensors.BY_NAME[name].numpy_dtype, name


def test_config_defaults_share_one_source() -> None:
    engine = EngineConfig(model="x")
    settings = resolve_settings({"checkpoint": "x"}, environ={})
    spec = model_repo.ModelSpec("x", "x")
    for name in ("max_rows", "max_canvas", "max_prompt", "max_queue"):
        want = getattr(limits, name.upper())
        assert getattr(engine, name) == getattr(settings, name) == spec.value(name) == want
        assert f'key: "{name}" value: {{ string_value: "{want}" }}' in model_repo.render_config(
            spec, "KIND_CPU"
        )
    assert engine.default_max_tokens == limits.DEFAULT_MAX_TOKENS
    assert ProxyConfig().max_tokens_limit == limits.PROXY_MAX_TOKENS_LIMIT
    # No other default hides in the engine's fields for the shared names: the registry's.
    for f in dataclasses.fields(EngineConfig):
        assert f.default is dataclasses.MISSING or f.default == SETTINGS[f.name].default
        if hasattr(limits, f.name.upper()):
            assert f.default == getattr(limits, f.name.upper()), f.name


def test_cli_has_a_flag_per_key() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(
        ["generate", "hi", "--max-nfe", "3", "--stop", "a", "--stop", "b", "--suppress-eos"]
    )
    assert cli._sampling(args) == {"max_nfe": 3, "stop": ["a", "b"], "suppress_eos": True}
    for param in PARAMS:
        assert hasattr(args, param.name), param.name


def test_api_doc_tables_are_generated_from_the_contract() -> None:
    text = docgen.API_DOC.read_text()
    assert docgen.sections_in(text) == set(docgen.SECTIONS)
    assert docgen.render(text) == text, "run python -m dlm_protocol.docgen"
    for param in PARAMS:
        assert f"| `{param.name}` |" in text


def test_contract_is_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys, dlm_protocol, dlm_protocol.docgen, openai_proxy.schemas; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_every_package_is_in_the_wheel() -> None:
    """Non-editable installs (the proxy image) get only the packages pyproject lists."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    dirs = {"dlm_client": root / "client"}
    for top in ("dlm_protocol", "dlm_engine", "dlm_lab", "dlm_triton", "openai_proxy"):
        dirs[top] = root / top
    found = set()
    for name, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert found <= listed, f"add to pyproject's packages: {sorted(found - listed)}"
