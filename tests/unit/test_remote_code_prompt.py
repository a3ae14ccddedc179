"""Real checkpoints name their remote code (`auto_map` in config.json, and Dream's tokenizer in
tokenizer_config.json); transformers then asks "run the custom code? [y/N]" unless told. The
fixtures carry the published keys, and loading one never asks, also with stdin closed (a
server, a container): the loader passes trust_remote_code=False and runs no remote code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlm_lab.testing import AUTO_MAPS, make_tiny_checkpoint

ASSETS = Path(__file__).resolve().parents[2] / "dlm_engine" / "assets"
PROMPT = "custom code"
LOAD = "import sys; from dlm_engine.loader import load_checkpoint; load_checkpoint(sys.argv[1])"
BARE = (
    "import sys; from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(sys.argv[1])"
)


def _run(code: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote-code")
    return {f: make_tiny_checkpoint(root / f, f) for f in ("llada", "dream", "sdar", "llada2")}


def test_fixtures_and_assets_carry_the_published_keys(checkpoints) -> None:
    for family, path in checkpoints.items():
        cfg = json.loads((path / "config.json").read_text())
        assert cfg["auto_map"] == AUTO_MAPS[family], family
    assert json.loads((checkpoints["sdar"] / "config.json").read_text())["fuse_cross_entropy"]
    tok = json.loads((checkpoints["dream"] / "tokenizer_config.json").read_text())
    assert "AutoTokenizer" in tok["auto_map"]
    sdar = json.loads((ASSETS / "tiny-sdar" / "config.json").read_text())
    assert sdar["auto_map"] == AUTO_MAPS["sdar"] and sdar["fuse_cross_entropy"] is True
    dlm = json.loads((ASSETS / "tiny-dlm" / "config.json").read_text())
    assert dlm["auto_map"] == AUTO_MAPS["llada"]


def test_plain_transformers_would_ask(checkpoints) -> None:
    """The hazard is real: transformers left to itself asks on Dream's published tokenizer."""
    done = _run(BARE, checkpoints["dream"])
    assert PROMPT in done.stdout + done.stderr


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2"])
def test_loading_never_asks(checkpoints, family) -> None:
    done = _run(LOAD, checkpoints[family])
    assert done.returncode == 0, done.stderr[-2000:]
    assert PROMPT not in done.stdout + done.stderr


def test_embedded_models_load_without_asking() -> None:
    for name in ("tiny-sdar", "tiny-dlm"):
        done = _run(LOAD, ASSETS / name)
        assert done.returncode == 0, done.stderr[-2000:]
        assert PROMPT not in done.stdout + done.stderr
