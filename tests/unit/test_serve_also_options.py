"""``dlm-triton serve --also``: which models one tritonserver loads beside the main one (no
server started here; tests/integration/test_serve_companions.py starts one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dlm_triton.launch import cli, launcher, model_repo
from dlm_triton.launch.launcher import Ports, TritonServerProcess, proxy_command


@pytest.fixture(autouse=True)
def _no_checkpoint_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLM_CHECKPOINT", raising=False)


def _repository(root: Path, *, companion: bool = True, asset: bool = True) -> Path:
    """tiny-dlm (the committed entry) and, if asked, a ``tiny-sdar`` entry whose checkpoint is
    a folder (``asset``) or a name that resolves to none."""
    repo = root / "repo"
    shutil.copytree(model_repo.COMMITTED_REPOSITORY / "tiny-dlm", repo / "tiny-dlm")
    if companion:
        folder = root / "tiny-sdar-ckpt"
        if asset:
            folder.mkdir()
        checkpoint = str(folder) if asset else "no-such-asset-tiny-sdar"
        model_repo.write_model(repo, model_repo.ModelSpec("tiny-sdar", checkpoint, max_rows=4))
    return repo


@pytest.fixture()
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    repo = _repository(tmp_path)
    monkeypatch.setenv("DLM_MODEL_REPOSITORY", str(repo))
    return repo


def _choose(model: str | Path | None, also, **kw):
    return TritonServerProcess(model, device="cpu", also=also, **kw)._choose_model()


def test_also_loads_more_models_of_the_repository_with_the_same_env(repo: Path) -> None:
    choice = _choose(None, ["tiny-sdar"], dtype="float32", engine_params={"max_rows": "2"})
    assert choice.repository == repo and choice.runtime_dir is None
    assert choice.names == ["tiny-dlm", "tiny-sdar"]
    assert choice.env["DLM_DEVICE"] == "cpu" and choice.env["DLM_DTYPE"] == "float32"
    assert choice.env["DLM_MAX_ROWS"] == "2"
    assert _choose("tiny-dlm", ()).names == ["tiny-dlm"]
    assert _choose("tiny-dlm", "tiny-sdar").names == ["tiny-dlm", "tiny-sdar"]


def test_also_beside_a_checkpoint_directory_is_refused_by_name(repo: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "my-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    for model in (ckpt, "random:llada-8b"):
        with pytest.raises(ValueError, match="--also tiny-sdar") as err:
            _choose(model, ["tiny-sdar"])
        assert "checkpoint" in str(err.value) and "without --also" in str(err.value)


def test_unknown_also_lists_the_known_models(repo: Path) -> None:
    with pytest.raises(ValueError, match="--also 'nope' is not a model in") as err:
        _choose(None, ["nope"])
    assert "known: tiny-dlm, tiny-sdar" in str(err.value)


def test_duplicates_are_refused(repo: Path) -> None:
    with pytest.raises(ValueError, match="given twice"):
        _choose(None, ["tiny-sdar", "tiny-sdar"])
    with pytest.raises(ValueError, match="'tiny-dlm' is the main model"):
        _choose("tiny-dlm", ["tiny-dlm"])


def test_a_checkpoint_every_model_would_read_is_refused(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="DLM_CHECKPOINT is set"):
        _choose(None, ["tiny-sdar"], engine_params={"checkpoint": "/somewhere"})
    monkeypatch.setenv("DLM_CHECKPOINT", "/elsewhere")
    with pytest.raises(ValueError, match="DLM_CHECKPOINT is set"):
        _choose(None, ["tiny-sdar"])
    monkeypatch.delenv("DLM_CHECKPOINT")
    # A Hub id is fetched by the launcher and handed over through DLM_CHECKPOINT.
    model_repo.write_model(repo, model_repo.ModelSpec("hub-model", "some-org/some-model"))
    with pytest.raises(ValueError, match="'hub-model' loads some-org/some-model"):
        _choose("hub-model", ["tiny-sdar"])
    with pytest.raises(ValueError, match="'hub-model' loads"):
        _choose(None, ["hub-model"])


def test_proxy_gets_one_model_flag_each_main_first() -> None:
    pytest.importorskip("openai_proxy.__main__")
    cmd = proxy_command(Ports(1, 2, 3, 4), ["tiny-dlm", "tiny-sdar"], "127.0.0.1")
    assert cmd is not None
    models = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--model"]
    assert models == ["tiny-dlm", "tiny-sdar"]
    single = proxy_command(Ports(1, 2, 3, 4), "tiny-dlm", "127.0.0.1")
    assert [single[i + 1] for i, a in enumerate(single) if a == "--model"] == ["tiny-dlm"]


def _also(argv: list[str]) -> list[str]:
    return cli.served_also(cli.build_parser().parse_args(["serve", *argv]))


def test_cli_default_serves_the_embedded_companions_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert launcher.EMBEDDED_COMPANIONS == ("tiny-sdar",)
    cases = {
        "present": _repository(tmp_path / "a"),
        "no entry": _repository(tmp_path / "b", companion=False),
        "no asset": _repository(tmp_path / "c", asset=False),
    }
    for case, repo in cases.items():
        monkeypatch.setenv("DLM_MODEL_REPOSITORY", str(repo))
        want = ["tiny-sdar"] if case == "present" else []
        assert _also([]) == want, case
        assert _also(["--no-also"]) == []
        assert _also(["--model", "tiny-dlm"]) == []  # an explicit model: only that one
        assert _also(["--model", "tiny-dlm", "--also", "x", "--also", "y"]) == ["x", "y"]
    monkeypatch.setenv("DLM_MODEL_REPOSITORY", str(cases["present"]))
    monkeypatch.setenv("DLM_CHECKPOINT", "/elsewhere")  # would reach every model: none
    assert _also([]) == []
    with pytest.raises(SystemExit):
        _also(["--also", "tiny-sdar", "--no-also"])


def test_cli_serve_reports_a_refused_also(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(launcher, "find_server", lambda: object())  # no tritonserver needed
    monkeypatch.setattr(TritonServerProcess, "install_signal_handlers", lambda self: None)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    argv = ["serve", "--device", "cpu", "--no-proxy", "--model", str(ckpt), "--also", "tiny-sdar"]
    assert cli.main(argv) == 2
    assert "error: --also tiny-sdar" in capsys.readouterr().err
    assert cli.main(["serve", "--device", "cpu", "--no-proxy", "--also", "nope"]) == 2
    assert "known: tiny-dlm, tiny-sdar" in capsys.readouterr().err
