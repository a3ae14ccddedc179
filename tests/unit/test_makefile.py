"""`make serve` installs what serving needs, on the CPU build of torch where no GPU is found;
`make test` adds the dev tools. Read from `make -n` (prints the recipes, runs none)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this host")


def _dry_run(target: str, tmp_path: Path, path: str, *args: str) -> str:
    env = {**os.environ, "PATH": path}
    venv = tmp_path / "venv"  # no stamps there: every install step is printed
    out = subprocess.run(
        ["make", "-n", target, f"VENV={venv}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def _path_with_fake_nvidia_smi(tmp_path: Path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_serve_installs_serving_extras_only_on_cpu_torch(tmp_path: Path) -> None:
    text = _dry_run("venv", tmp_path, "/usr/bin:/bin")
    assert f"torch==2.13.0 {CPU_INDEX}" in text
    assert '-e ".[serve,quant]"' in text
    assert ".[serve,dev,quant]" not in text  # Playwright, schemathesis, kubectl: tests only


def test_test_adds_the_dev_extra(tmp_path: Path) -> None:
    text = _dry_run("lint", tmp_path, "/usr/bin:/bin")
    assert '-e ".[serve,quant]"' in text and '-e ".[serve,dev,quant]"' in text


def test_a_gpu_host_keeps_pypis_torch_and_the_index_can_be_chosen(tmp_path: Path) -> None:
    text = _dry_run("venv", tmp_path, _path_with_fake_nvidia_smi(tmp_path))
    assert "--extra-index-url" not in text
    cu = "https://download.pytorch.org/whl/cu130"
    text = _dry_run("venv", tmp_path, "/usr/bin:/bin", f"TORCH_INDEX_URL={cu}")
    assert f"--extra-index-url {cu}" in text


def test_the_venv_python_is_one_the_lock_is_resolved_for(tmp_path: Path) -> None:
    text = _dry_run("venv", tmp_path, "/usr/bin:/bin")
    python = text.split(" -m venv ", 1)[0].rsplit(" ", 1)[-1]
    assert python in ("/usr/bin/python3.11", "/usr/bin/python3.12"), python
    text = _dry_run("venv", tmp_path, "/usr/bin:/bin", "PYTHON_VERSION=3.12")
    assert "/usr/bin/python3.12 -m venv" in text and "libpython3.12" in text
