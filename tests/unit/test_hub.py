"""Hub ids: a pre-seeded Hugging Face cache loads offline by id; what is missing or damaged is
one clear error before any tensor is read. No network: the cache is written in
huggingface_hub's layout (``dlm_lab.testing.seed_hub_cache``) and read by its own code."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from dlm_engine.hub import (
    CHECKPOINT_FILES,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    hub_token,
    is_hub_id,
    resolve_checkpoint,
)
from dlm_engine.loader import load_checkpoint
from dlm_lab.testing import seed_hub_cache

REPO = "test-org/Tiny-LLaDA"
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@pytest.fixture()
def hub_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME, offline, with no token or endpoint leaking in from the machine."""
    home = tmp_path / "hf-home"
    for var in ("HF_HUB_CACHE", "HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture()
def seeded(hub_home: Path, ckpt_dir: dict[str, Path]) -> Path:
    """``REPO`` in the cache at COMMIT_A (= main); returns its snapshot folder."""
    return seed_hub_cache(ckpt_dir["llada"], hub_home / "hub", REPO, COMMIT_A)


def test_seeded_cache_is_what_huggingface_hub_sees(seeded: Path, hub_home: Path) -> None:
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_home / "hub")
    (repo,) = info.repos
    assert repo.repo_id == REPO and not info.warnings
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT_A and revision.refs == frozenset({"main"})


def test_offline_load_by_id_equals_the_directory(seeded: Path, ckpt_dir: dict[str, Path]) -> None:
    assert resolve_checkpoint(REPO) == seeded
    by_id = load_checkpoint(REPO)
    by_dir = load_checkpoint(ckpt_dir["llada"])
    assert by_id.path == seeded
    a, b = by_id.model.state_dict(), by_dir.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert by_id.tokenizer.get_vocab() == by_dir.tokenizer.get_vocab()
    assert (by_id.mask_id, by_id.eos_id) == (by_dir.mask_id, by_dir.eos_id)


def test_a_pinned_revision_picks_its_snapshot(
    seeded: Path, hub_home: Path, ckpt_dir: dict[str, Path]
) -> None:
    other = seed_hub_cache(ckpt_dir["dream"], hub_home / "hub", REPO, COMMIT_B, refs=())
    assert resolve_checkpoint(REPO) == seeded  # main
    assert resolve_checkpoint(REPO, COMMIT_B) == other
    assert load_checkpoint(REPO, revision=COMMIT_B).family.name == "dream"
    with pytest.raises(CheckpointNotFoundError, match="revision v9"):
        resolve_checkpoint(REPO, "v9")


def test_a_local_directory_wins_over_a_hub_id(
    seeded: Path, tmp_path: Path, ckpt_dir: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "test-org" / "Tiny-LLaDA"
    local.parent.mkdir()
    local.symlink_to(ckpt_dir["dream"], target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint(REPO) == Path(REPO)
    assert load_checkpoint(REPO).family.name == "dream"


def test_missing_id_offline_names_the_id_and_the_cache(hub_home: Path) -> None:
    with pytest.raises(CheckpointNotFoundError) as err:
        load_checkpoint("test-org/not-there")
    message = str(err.value)
    assert "'test-org/not-there'" in message
    assert str(hub_home / "hub") in message
    assert "HF_HUB_OFFLINE" in message and "hf download test-org/not-there" in message
    assert message.count("\n") == 0  # one line, not a traceback dump


def test_unreachable_hub_falls_back_to_the_cache_and_says_so_when_missing(
    seeded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert resolve_checkpoint(REPO) == seeded
    with pytest.raises(CheckpointNotFoundError, match="could not be reached") as err:
        resolve_checkpoint("test-org/not-there")
    assert "test-org/not-there" in str(err.value)


def test_a_truncated_shard_is_caught_before_loading(seeded: Path) -> None:
    shard = sorted(seeded.glob("*.safetensors"))[-1]
    blob = shard.resolve()
    data = blob.read_bytes()
    blob.write_bytes(data[: len(data) - 100])  # an interrupted copy
    with pytest.raises(CorruptCheckpointError) as err:
        load_checkpoint(REPO)
    message = str(err.value)
    assert shard.name in message and REPO in message
    assert f"{len(data) - 100} bytes" in message and f"describes {len(data)}" in message


def test_a_shard_missing_from_the_index_is_named(seeded: Path) -> None:
    shard = sorted(seeded.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CorruptCheckpointError, match=f"incomplete: {shard.name}"):
        load_checkpoint(REPO)


def test_a_damaged_shard_of_the_right_size_fails_its_hash(
    seeded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = sorted(seeded.glob("*.safetensors"))[0]
    blob = shard.resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # same size, other content: only a hash sees it
    blob.write_bytes(bytes(data))
    assert resolve_checkpoint(REPO) == seeded  # the default size check passes
    with pytest.raises(CorruptCheckpointError, match="sha256"):
        resolve_checkpoint(REPO, verify="sha256")
    monkeypatch.setenv("DLM_VERIFY_CHECKPOINT", "sha256")
    with pytest.raises(CorruptCheckpointError, match=shard.name):
        load_checkpoint(REPO)


def test_a_truncated_shard_in_a_plain_directory_is_caught(
    tmp_path: Path, ckpt_dir: dict[str, Path]
) -> None:
    import shutil

    copy = Path(shutil.copytree(ckpt_dir["dream"], tmp_path / "copy"))
    shard = sorted(copy.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:4])  # shorter than a header
    with pytest.raises(CorruptCheckpointError, match="not a safetensors file"):
        load_checkpoint(copy)


def test_only_loader_files_are_fetched() -> None:
    from huggingface_hub.utils import filter_repo_objects

    published = [
        "config.json", "generation_config.json", "model.safetensors.index.json",
        "model-00001-of-00006.safetensors", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "vocab.json", "merges.txt", "modeling_llada.py",
        "configuration_llada.py", "pytorch_model-00001-of-00006.bin", "README.md",
        "tokenization_dream.py", "generation_utils.py", "original/consolidated.pth",
    ]  # fmt: skip
    fetched = set(filter_repo_objects(published, allow_patterns=CHECKPOINT_FILES))
    assert not {f for f in fetched if f.endswith((".py", ".bin", ".pth", ".md"))}
    assert {"config.json", "model-00001-of-00006.safetensors", "tokenizer.json"} <= fetched


def test_hub_ids_and_tokens() -> None:
    assert is_hub_id("GSAI-ML/LLaDA-8B-Instruct") and is_hub_id("Dream-org/Dream-v0-Instruct-7B")
    for ref in ("tiny-dlm", "/ckpt/x", "a/b/c", "../x", "random:llada-8b", "a/.."):
        assert not is_hub_id(ref), ref
    with pytest.raises(CheckpointNotFoundError, match="neither a local directory"):
        resolve_checkpoint("no-such-dir")


def test_token_from_a_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "hf_token"
    secret.write_text("hf_secret\n")
    assert hub_token({"HF_TOKEN_PATH": str(secret)}) == "hf_secret"
    assert hub_token({"HF_TOKEN": "hf_env", "HF_TOKEN_PATH": str(secret)}) == "hf_env"
    secret.write_text("")
    assert hub_token({"HF_TOKEN_PATH": str(secret)}) is None  # an empty secret = anonymous
    assert hub_token({"HF_TOKEN_PATH": str(tmp_path / "absent")}) is None
