"""The environment a real tritonserver and its Python stub run with (the wheel's server here;
the image's case is checked in tests/unit/test_server_env.py): no system library folder on
LD_LIBRARY_PATH, and torch's libraries loaded from the torch package itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlm_triton.launch.launcher import TritonServerProcess

SYSTEM_LIB_DIRS = {"/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib", "/lib",
                   "/usr/lib64", "/lib64", "/usr/local/lib"}  # fmt: skip


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.integration
def test_server_and_stub_library_path(triton_server: TritonServerProcess) -> None:
    import torch

    assert triton_server.server is not None
    stubs = triton_server.stub_pids()
    assert stubs, "no Python backend stub running"
    for pid in [triton_server.server.pid, *stubs]:
        entries = _environ(pid).get("LD_LIBRARY_PATH", "").split(os.pathsep)
        assert not SYSTEM_LIB_DIRS & {os.path.normpath(e) for e in entries if e}, entries
    torch_dir = Path(torch.__file__).resolve().parent
    maps = Path(f"/proc/{stubs[0]}/maps").read_text().splitlines()
    torch_libs = {line.split()[-1] for line in maps if "libtorch" in line.split()[-1]}
    assert torch_libs, "the stub has not loaded torch"
    assert all(Path(lib).resolve().is_relative_to(torch_dir) for lib in torch_libs), torch_libs
