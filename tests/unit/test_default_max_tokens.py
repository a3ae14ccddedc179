"""max_tokens of a request that names none: the checkpoint's published generation length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlm_engine import Engine, EngineConfig
from dlm_engine.decoding.checkpoint_defaults import generation_length
from dlm_engine.models import family_of
from dlm_lab.testing import TINY_GENERATION_LENGTH, make_tiny_checkpoint
from dlm_protocol.settings import ASSETS_DIR


def _without_length(path: Path) -> Path:
    """The checkpoint's generation config as its family publishes it (no length key)."""
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text())
    del gen["max_new_tokens"]
    gen_file.write_text(json.dumps(gen))
    return path


@pytest.mark.parametrize(("family", "length"), [("llada", 128), ("dream", 512), ("sdar", 128)])
def test_family_length_without_a_generation_config_length(
    family: str, length: int, tmp_path: Path
) -> None:
    path = _without_length(make_tiny_checkpoint(tmp_path / family, family))
    assert generation_length(path, family) == family_of(family).generation_length == length
    engine = Engine(EngineConfig(model=str(path), max_canvas=1024))
    assert engine.resolve_params({}).max_tokens == length
    small = Engine(EngineConfig(model=str(path), max_canvas=96), loaded=engine.loaded)
    assert small.resolve_params({}).max_tokens == 96  # capped by the server's canvas
    assert engine.resolve_params({"max_tokens": 8}).max_tokens == 8  # the request wins


def test_generation_config_and_server_setting_win(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "llada", "llada")
    gen_file = path / "generation_config.json"
    assert json.loads(gen_file.read_text())["max_new_tokens"] == TINY_GENERATION_LENGTH
    engine = Engine(EngineConfig(model=str(path)))
    assert engine.resolve_params({}).max_tokens == TINY_GENERATION_LENGTH
    gen_file.write_text(json.dumps({"eos_token_id": 1, "gen_length": 40}))  # LLaDA's name
    assert generation_length(path, "llada") == 40
    server = Engine(EngineConfig(model=str(path), default_max_tokens=24), loaded=engine.loaded)
    assert server.resolve_params({}).max_tokens == 24
    for bad in ({"max_new_tokens": 0}, {"max_new_tokens": True}, {"max_new_tokens": None}, []):
        gen_file.write_text(json.dumps(bad))
        assert generation_length(path, "llada") == 128
    gen_file.write_text("{not json")
    assert generation_length(path, "dream") == 512


@pytest.mark.parametrize("name", ["tiny-dlm", "tiny-sdar"])
def test_embedded_models_keep_their_length(name: str) -> None:
    family = "sdar" if name == "tiny-sdar" else "llada"
    assert generation_length(ASSETS_DIR / name, family) == 64
