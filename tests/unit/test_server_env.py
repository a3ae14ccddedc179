"""The environment the launcher gives tritonserver and its stubs, for each server source.

A system library folder on LD_LIBRARY_PATH is searched before the torch wheel's RUNPATH, so in
NVIDIA's image torch would load the image's NCCL/cuDNN: no such folder may be added, ever.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from dlm_triton.launch import server_dist
from dlm_triton.launch.server_dist import find_server, libpython_dir, model_env

SYSTEM_LIB_DIRS = {"/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib", "/lib",
                   "/usr/lib64", "/lib64", "/usr/local/lib"}  # fmt: skip
# What NVIDIA's tritonserver image sets (compat libs first; the entrypoint manages them).
IMAGE_LD_PATH = "/usr/local/cuda/compat/lib.real:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"


def fake_system_install(root: Path) -> Path:
    """``/opt/tritonserver`` as in NVIDIA's image: bin/tritonserver, backends/python, lib."""
    binary = root / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    (root / "backends" / "python").mkdir(parents=True)
    (root / "lib").mkdir()
    return binary


def test_image_server_gets_the_image_environment_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = fake_system_install(tmp_path / "opt" / "tritonserver")
    monkeypatch.setenv("PATH", f"{binary.parent}:/usr/local/bin:/usr/bin:/bin")
    monkeypatch.setenv("LD_LIBRARY_PATH", IMAGE_LD_PATH)
    dist = find_server(prefer="system")
    assert dist.source == "system" and dist.binary == binary
    assert dist.backend_dir == binary.parent.parent / "backends"
    assert dist.env["LD_LIBRARY_PATH"] == IMAGE_LD_PATH  # nothing in front, nothing added
    if sys.prefix == sys.base_prefix:  # the image installs into its system Python: PATH kept
        assert dist.env["PATH"] == os.environ["PATH"]


def test_image_server_without_ld_library_path_gets_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = fake_system_install(tmp_path / "tritonserver")
    monkeypatch.setenv("PATH", f"{binary.parent}:/usr/bin:/bin")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert "LD_LIBRARY_PATH" not in find_server(prefer="system").env


def test_wheel_server_gets_its_own_libraries_and_libpython_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if server_dist.wheel_root() is None:
        pytest.skip("the nvidia-pytriton wheel is not installed (serve extra)")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/site/lib")
    dist = find_server(prefer="wheel", cache=tmp_path)
    assert dist.source == "wheel"
    entries = dist.env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert entries[-1] == "/opt/site/lib"  # the operator's own setting stays, last
    assert not SYSTEM_LIB_DIRS & {os.path.normpath(e) for e in entries}
    ours = [Path(e) for e in entries[:-1]]
    assert ours[0].name == "nvidia_pytriton.libs"
    libpython = ours[-1]
    assert libpython.is_relative_to(tmp_path)
    (link,) = libpython.iterdir()  # exactly one library exposed: the stub's libpython
    assert link.name.startswith(f"libpython{sys.version_info.major}.{sys.version_info.minor}")
    assert link.resolve().exists()
    if sys.prefix != sys.base_prefix:  # the stub finds the venv's site-packages via PATH
        assert dist.env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_libpython_dir_is_stable_and_idempotent(tmp_path: Path) -> None:
    first = libpython_dir(tmp_path)
    if first is None:
        pytest.skip("this Python has no shared libpython")
    before = {p.name: p.resolve() for p in first.iterdir()}
    assert libpython_dir(tmp_path) == first
    assert {p.name: p.resolve() for p in first.iterdir()} == before


def test_explicit_server_gets_its_lib_folder_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = fake_system_install(tmp_path / "custom")
    monkeypatch.setenv("DLM_TRITONSERVER", str(binary))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    dist = find_server()
    assert dist.source == "env"
    assert dist.env["LD_LIBRARY_PATH"] == str(binary.parent.parent / "lib")


def test_model_env_adds_only_what_it_is_given() -> None:
    env = model_env({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/a"}, [Path("/w/libs")])
    assert env["LD_LIBRARY_PATH"] == "/w/libs:/a"
    assert "LD_LIBRARY_PATH" not in model_env({"PATH": "/usr/bin"})
