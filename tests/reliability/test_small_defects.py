"""The smaller defects of issue 13, point 4, each with its check."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from reliability_stack import require_triton

from dlm_engine import Engine, EngineConfig, EngineLoop
from dlm_engine.testing import make_tiny_checkpoint
from dlm_triton.launcher import SHM_DIR, Ports, TritonServerProcess
from dlm_triton.request_parse import RequestError, parse_request


def _text(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


def test_deeply_nested_json_is_a_bad_request_not_a_recursion_error() -> None:
    nested = "[" * 100_000 + "]" * 100_000
    prompt = {"text_input": _text("hi")}
    with pytest.raises(RequestError, match="invalid request: sampling_parameters: JSON nested"):
        parse_request({**prompt, "sampling_parameters": _text(nested)}, None)
    with pytest.raises(RequestError, match="invalid request: parameters: JSON nested"):
        parse_request(prompt, json.dumps({"a": 1})[:-1] + ', "b": ' + nested + "}")
    with pytest.raises(RequestError, match="invalid request: messages: JSON nested"):
        parse_request({"messages": _text(nested)}, None)


def test_queue_depth_counts_requests_not_cancels(tmp_path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "llada", "llada", seed=1)
    loop = EngineLoop(Engine(EngineConfig(model=str(ckpt))))
    loop.shutdown()  # the engine thread is gone: whatever is put in the inbox stays there
    for i in range(5):
        loop.cancel(f"gone-{i}")
    assert loop.queue_depth == 0
    params = loop.engine.resolve_params({"max_tokens": 4})
    loop.submit("a", [1, 2], params, lambda out: None)
    loop.submit("b", [1, 2], params, lambda out: None)
    assert loop.queue_depth == 2


@pytest.mark.integration
def test_failed_start_leaves_no_shm_behind(tmp_path) -> None:
    """The HTTP port is taken: tritonserver loads the model (its stub and shm regions exist),
    then fails to bind and exits. The launcher removes the regions by its own prefix."""
    require_triton()
    ckpt = make_tiny_checkpoint(tmp_path / "llada", "llada", seed=1)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = Ports.free()
    ports.http = taken.getsockname()[1]
    server = TritonServerProcess(
        ckpt, device="cpu", ports=ports, log_path=tmp_path / "t.log", ready_timeout_s=180
    )
    try:
        with pytest.raises(RuntimeError, match="exited"):
            server.start()
    finally:
        taken.close()
        server.stop()
    log = (tmp_path / "t.log").read_text()
    assert "successfully loaded" in log  # the model (and its shm) came up before the failure
    assert not list(SHM_DIR.glob(f"{server.shm_prefix}*"))
    assert server.server is None
