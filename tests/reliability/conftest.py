"""One supervised stack (tritonserver + proxy, tiny random LLaDA) shared by the reliability
tests that need a server; tests that kill it wait until it is back before they end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from reliability_stack import require_triton, start_stack

from dlm_lab.testing import make_tiny_checkpoint
from dlm_triton.launch.launcher import TritonServerProcess


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServerProcess]:
    require_triton()
    root = tmp_path_factory.mktemp("reliability")
    server = start_stack(make_tiny_checkpoint(root / "ckpt", "llada", seed=3), root)
    server.supervise()
    try:
        yield server
    finally:
        server.stop()
