"""Fixtures that start a real tritonserver through the launcher (the code ``dlm-triton serve``
runs), on free ports, with the CPU config and a tiny random checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dlm_client import DLMClient
from triton_metrics import read_metric, settled_metric

from dlm_triton.launch.launcher import Ports, TritonServerProcess
from dlm_triton.launch.server_dist import TritonNotFoundError, find_server

TEST_MODEL = "tiny-test"


def triton_available() -> bool:
    try:
        find_server()
    except TritonNotFoundError:
        return False
    return True


requires_triton = pytest.mark.skipif(not triton_available(), reason="no tritonserver available")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    testing = pytest.importorskip("dlm_lab.testing")
    return testing.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llada", "llada")


def start_server(
    checkpoint: Path, log_dir: Path, name: str = TEST_MODEL, **kw
) -> TritonServerProcess:
    """A server on free ports; the caller stops it."""
    server = TritonServerProcess(
        checkpoint,
        model_name=name,
        device="cpu",
        ports=Ports.free(),
        log_path=log_dir / f"{name}-triton.log",
        ready_timeout_s=180,
        exit_timeout_s=5,
        **kw,
    )
    return server.start()


@pytest.fixture(scope="session")
def triton_server(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServerProcess]:
    if not triton_available():
        pytest.skip("no tritonserver available")
    server = start_server(tiny_checkpoint, tmp_path_factory.mktemp("logs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def client(triton_server: TritonServerProcess) -> DLMClient:
    return DLMClient(
        triton_server.urls["grpc"], triton_server.model_name, http_url=triton_server.urls["http"]
    )


@pytest.fixture()
def metric(triton_server: TritonServerProcess):
    """``metric(name, **labels)``: the summed value on the session server's metrics port."""
    return lambda name, **labels: read_metric(triton_server, name, **labels)


@pytest.fixture()
def settled(triton_server: TritonServerProcess):
    """``settled(name)``: the metric once it stopped changing (step figures come in batches)."""
    return lambda name: settled_metric(triton_server, name)


@pytest.fixture()
def server_factory(tmp_path: Path):
    """Start extra servers (for shutdown tests); any left running are stopped afterwards."""
    started: list[TritonServerProcess] = []

    def factory(checkpoint: Path, name: str = "tiny-extra", **kw) -> TritonServerProcess:
        server = start_server(checkpoint, tmp_path, name, **kw)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
