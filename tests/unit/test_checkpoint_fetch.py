"""The launcher fetches the checkpoint a served model names before tritonserver starts, and
hands the stub the local folder; what cannot be fetched stops `dlm-triton serve` with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dlm_engine.hub import CheckpointNotFoundError
from dlm_lab.testing import seed_hub_cache
from dlm_triton.launch.checkpoint_fetch import fetch_checkpoint, served_checkpoint
from dlm_triton.launch.model_repo import COMMITTED_REPOSITORY, MODELS

ROOT = Path(__file__).resolve().parents[2]
LLADA = next(m for m in MODELS if m.name == "llada-8b-instruct")


@pytest.fixture()
def offline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("HF_HUB_CACHE", "HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT", "DLM_CHECKPOINT",
                "DLM_REVISION"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def test_a_committed_model_fetches_its_hub_id(
    offline_home: Path, ckpt_dir: dict[str, Path]
) -> None:
    assert LLADA.checkpoint == "GSAI-ML/LLaDA-8B-Instruct"
    main = seed_hub_cache(ckpt_dir["llada"], offline_home / "hub", LLADA.checkpoint, "1" * 40)
    pinned = seed_hub_cache(ckpt_dir["llada"], offline_home / "hub", LLADA.checkpoint, "2" * 40, ())
    env = fetch_checkpoint(COMMITTED_REPOSITORY, LLADA.name)
    assert env == {"DLM_CHECKPOINT": str(main)}
    env = fetch_checkpoint(COMMITTED_REPOSITORY, LLADA.name, {"DLM_REVISION": "2" * 40})
    assert env == {"DLM_CHECKPOINT": str(pinned)}


def test_local_models_need_no_fetch(offline_home: Path, ckpt_dir: dict[str, Path]) -> None:
    assert fetch_checkpoint(COMMITTED_REPOSITORY, "tiny-dlm") == {}  # an embedded asset
    env = {"DLM_CHECKPOINT": str(ckpt_dir["dream"])}
    assert fetch_checkpoint(COMMITTED_REPOSITORY, LLADA.name, env) == {}  # a directory wins
    checkpoint, _ = served_checkpoint(COMMITTED_REPOSITORY / "tiny-dlm" / "config.pbtxt", {})
    assert checkpoint is not None and Path(checkpoint).is_dir()


def test_a_missing_committed_model_names_the_id(offline_home: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="GSAI-ML/LLaDA-8B-Instruct"):
        fetch_checkpoint(COMMITTED_REPOSITORY, LLADA.name)


def test_serve_stops_with_one_line_when_the_model_cannot_be_fetched(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "dlm_triton.launch.cli", "serve", "--model", "test-org/absent",
         "--no-proxy", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (
        "error: Hub model 'test-org/absent' (revision main) is not in the Hugging Face cache"
        in (proc.stderr)
    )
