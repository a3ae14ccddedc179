"""The embedded tiny-dlm on its own tritonserver (what `dlm-triton serve` serves), for test
modules that need clean gauges and memory rather than the session server (a plain module:
importable from any test, unlike a conftest)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from dlm_protocol.settings import ASSETS_DIR
from dlm_triton.launch.launcher import Ports, TritonServerProcess
from dlm_triton.launch.server_dist import TritonNotFoundError, find_server

EMBEDDED_MODEL = ASSETS_DIR / "tiny-dlm"


@contextmanager
def embedded_server(log_dir: Path, ready_timeout_s: float, **kw) -> Iterator[TritonServerProcess]:
    """tiny-dlm on free ports (skips where there is no tritonserver); stopped by PID after."""
    try:
        find_server()
    except TritonNotFoundError:
        pytest.skip("no tritonserver available")
    server = TritonServerProcess(
        EMBEDDED_MODEL,
        model_name="tiny-dlm",
        device="cpu",
        ports=Ports.free(),
        log_path=log_dir / "triton.log",
        ready_timeout_s=ready_timeout_s,
        exit_timeout_s=5,
        **kw,
    ).start()
    try:
        yield server
    finally:
        server.stop()
