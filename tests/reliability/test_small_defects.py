"""Smaller defects of the served stack, each with its check."""

from __future__ import annotations

import json
import queue
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from reliability_stack import MODEL, chat_body, metric_value, require_triton, start_stack

from dlm_engine import Engine, EngineConfig, EngineLoop
from dlm_lab.testing import make_tiny_checkpoint
from dlm_protocol.tensors import PROMPT_INPUT_NAMES, STREAM
from dlm_triton.backend.request_parse import RequestError, parse_request
from dlm_triton.launch.launcher import SHM_DIR, Ports, TritonServerProcess
from openai_proxy.triton_pool import server_capacity


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


SMALL_QUEUE = 4
# long enough (1024 steps per row) to hold a full queue for seconds
HELD = {"max_tokens": 1024, "steps": 1024, "block_length": 32, "suppress_eos": True}


def _wait_in_flight(stack: TritonServerProcess, want: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := metric_value(stack, "dlm_requests_in_flight")) != want:
        assert time.monotonic() < deadline, f"{got} requests in flight, waited for {want}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def small_queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServerProcess]:
    """A stack whose model admits 4 requests at once (max_queue in its Triton config)."""
    require_triton()
    root = tmp_path_factory.mktemp("small-queue")
    ckpt = make_tiny_checkpoint(root / "ckpt", "llada", seed=3)
    server = start_stack(ckpt, root, engine_params={"max_queue": str(SMALL_QUEUE)})
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.integration
def test_fanout_beyond_max_queue_is_a_400_naming_n(small_queue: TritonServerProcess) -> None:
    """A fan-out the model can never admit at once (n x prompts > its max_queue; one server,
    one instance) was a permanent 503 "try again later". The proxy reads max_queue from the
    model's Triton config: beyond it a 400 naming `n` with the limit; at the limit the call
    runs, and a queue that is merely full now still answers 503 + Retry-After."""
    cap, base = SMALL_QUEUE, f"http://127.0.0.1:{small_queue.ports.proxy}/v1"
    too_many = [
        ("chat/completions", chat_body(n=cap + 1)),
        ("chat/completions", chat_body(n=cap + 1, stream=True)),
        ("completions", {"model": MODEL, "prompt": ["a", "b"], "n": cap // 2 + 1}),
    ]
    for path, body in too_many:
        r = httpx.post(f"{base}/{path}", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert "retry-after" not in r.headers
        error = r.json()["error"]
        assert error["param"] == "n" and error["type"] == "invalid_request_error", error
        assert f"the {cap} requests this server admits at once" in error["message"], error
    assert metric_value(small_queue, "dlm_requests_in_flight") == 0  # refused before Triton
    chat = f"{base}/chat/completions"
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", chat, json=chat_body(n=cap, stream=True, **HELD)) as held,
    ):
        assert held.status_code == 200  # exactly the limit: admitted
        _wait_in_flight(small_queue, cap)
        r = http.post(chat, json=chat_body(), timeout=30)  # n=1 while the queue is full
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert r.json()["error"]["code"] == "overloaded", r.text
    _wait_in_flight(small_queue, 0)  # closing the held stream cancelled its requests
    r = httpx.post(chat, json=chat_body(n=2), timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_server_capacity_counts_every_instance() -> None:
    """max_queue is per instance: a KIND_GPU group runs one instance per listed GPU."""
    params = {"max_queue": {"string_value": "3"}}
    cpu = {"parameters": params, "instance_group": [{"count": 2, "kind": "KIND_CPU"}]}
    gpus = {"parameters": params, "instance_group": [{"count": 1, "gpus": [0, 1, 2, 3]}]}
    assert server_capacity(cpu) == 6 and server_capacity(gpus) == 12
    assert server_capacity({"parameters": params}) == 3
    assert server_capacity({"parameters": {}}) is None  # unknown: the proxy does not check


def _grpc_error(stack: TritonServerProcess, inputs: list) -> str:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(stack.urls["grpc"])
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    try:
        client.async_stream_infer(MODEL, inputs=inputs)
        error = answers.get(timeout=60)
    finally:
        client.stop_stream()
    assert error is not None, "answered without an error"
    return str(error)


@pytest.mark.integration
def test_triton_request_without_a_prompt_names_the_missing_input(
    stack: TritonServerProcess,
) -> None:
    """A Triton request with no prompt input is answered with the inputs it needs, over HTTP
    generate and gRPC, whatever other inputs or keys it carries. A request with no input
    tensor at all never reaches the model: Triton's Python backend reads input 0 for the batch
    size (max_batch_size > 0) and refuses it itself; that refusal is the request's own (the
    dynamic batcher never batches requests with different inputs), so a request beside it runs."""
    import tritonclient.grpc as grpcclient

    names = ", ".join(PROMPT_INPUT_NAMES)
    needed = f"invalid request: exactly one of {names} is required (got none)"
    generate = f"{stack.urls['http']}/v2/models/{MODEL}/generate"
    for body in ({"stream": False}, {"stream": False, "max_tokens": 4}):
        r = httpx.post(generate, json=body, timeout=30)
        assert r.status_code == 400 and needed in r.json()["error"], r.text
    stream = grpcclient.InferInput(STREAM.name, [1, 1], STREAM.datatype)
    stream.set_data_from_numpy(np.array([[False]]))
    assert needed in _grpc_error(stack, [stream])

    good = {"text_input": "hello", "max_tokens": 4, "steps": 4}
    with ThreadPoolExecutor(8) as pool:
        bare = [pool.submit(httpx.post, generate, json={"max_tokens": 4}) for _ in range(4)]
        fine = [pool.submit(httpx.post, generate, json=good, timeout=60) for _ in range(4)]
        assert all(f.result().status_code == 400 for f in bare)
        assert all(f.result().status_code == 200 for f in fine), [f.result().text for f in fine]
    assert _grpc_error(stack, [])  # gRPC: an error, not a hang
