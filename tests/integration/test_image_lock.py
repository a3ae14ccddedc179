"""The image environment is pinned and still resolves: docker/constraints.txt, resolved from
pyproject.toml + docker/requirements-image.in for the tritonserver image's Python (3.12) and
the suite's (3.11), must resolve to itself again (docker/lock.py --check), and the suite's own
versions must be the lock's. Needs PyPI (reachable in CI); skips only if it is not."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docker"))
import lock  # noqa: E402  (docker/lock.py: one definition of the resolution)

# Pins in the lock that this machine's suite cannot share, and why.
SUITE_EXCEPTIONS = {
    # The suite's torch is the CPU build of the same release (2.13.0+cpu, from the local wheel
    # the Makefile installs); the image's is PyPI's CUDA 13.0 build. Their CUDA libraries
    # (nvidia-*, cuda-toolkit, triton) exist only in the image.
    "torch": "same release, +cpu build",
}


def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen(lock.INDEX_URL + "/pip/", timeout=10) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_lock_pins_the_release_the_makefile_and_dockerfile_name() -> None:
    pins = lock.pins(lock.LOCK.read_text())
    makefile = re.search(r"^TORCH_VERSION \?= (\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert makefile and pins["torch"] == makefile.group(1)
    assert f"torch=={pins['torch']}" in (ROOT / "docker" / "requirements-image.in").read_text()
    assert int(pins["numpy"].split(".")[0]) < 2  # the 2.51 stub of the suite needs numpy<2
    assert "bitsandbytes" in pins and "huggingface-hub" in pins  # [quant], Hub downloads
    assert "nvidia-pytriton" not in pins  # the image uses its own tritonserver
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert f"ARG PROXY_BASE_IMAGE=python:{lock.IMAGE_PYTHON}-" in dockerfile
    assert f"sys.version_info[:2] == ({lock.IMAGE_PYTHON.replace('.', ', ')})" in dockerfile


def test_suite_runs_the_locked_versions() -> None:
    """Every locked package installed here has the lock's version (the Makefile installs with
    -c docker/constraints.txt); differences are listed with their reason above."""
    pins = lock.pins(lock.LOCK.read_text())
    installed = {
        re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
        for d in importlib.metadata.distributions()
    }
    wrong = {
        name: (version, installed[name])
        for name, version in pins.items()
        if name in installed
        and installed[name] != version
        and not (name in SUITE_EXCEPTIONS and installed[name].split("+")[0] == version)
    }
    assert not wrong, f"suite vs lock (name: (lock, installed)): {wrong}; run `make venv`"
    core = ("torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "numpy")
    assert all(name in installed for name in core)


def test_lock_resolves_again_for_the_image_and_the_suite() -> None:
    if not _pypi_reachable():
        pytest.skip(f"{lock.INDEX_URL} is unreachable: cannot re-resolve the image environment")
    problems = lock.check()
    assert not problems, "\n".join(problems) + "\nrun `python docker/lock.py` and commit"
