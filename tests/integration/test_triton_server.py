"""A real tritonserver (CPU config, tiny random LLaDA) through gRPC streaming and HTTP SSE."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from dlm_client import DLMClient, DLMError

from dlm_triton.backend.step_metrics import STEP_METRICS_EVERY_S

pytestmark = pytest.mark.integration

# Eight requests that differ in every setting a row carries on its own.
SETTINGS = [
    {"max_tokens": 16, "steps": 16},
    {"max_tokens": 24, "steps": 12, "block_length": 8},
    {"max_tokens": 32, "steps": 32, "algorithm": "random", "seed": 1},
    {"max_tokens": 16, "steps": 8, "temperature": 0.7, "seed": 3},
    {"max_tokens": 32, "steps": 16, "block_length": 16, "algorithm": "low_confidence"},
    {"max_tokens": 8, "steps": 8, "algorithm": "topk_margin"},
    {"max_tokens": 20, "steps": 10, "block_length": 10, "algorithm": "entropy"},
    {"max_tokens": 32, "steps": 32, "algorithm": "threshold", "threshold": 0.5},
]
PROMPTS = ["Hello there", "What is 2+2?", "abc", "Tell me a story", "x", "zz top", "q?", "ok"]

# A request that runs 500 steps whatever the random weights predict: the regex admits only
# 500 'a's, so no end-of-text can be committed early (suppress_eos alone still let the tiny
# checkpoint commit an end-of-turn token after about 17 steps: cancellation then raced the
# request's own end).
LONG_RUNNING = {"max_tokens": 512, "steps": 512, "stream_mode": "denoise", "regex": "a{500}"}


def test_grpc_streams_eight_concurrent_requests_in_shared_steps(
    client: DLMClient, metric, settled
) -> None:
    count0 = metric("dlm_rows_per_step_count")
    single0 = metric("dlm_rows_per_step_bucket", le="1")
    names = ("dlm_request_latency_seconds_count", "dlm_steps_per_request_count",
             "dlm_step_duration_seconds_count", "dlm_generated_tokens_total")  # fmt: skip
    before = {n: metric(n) for n in names}
    finished0 = sum(metric("dlm_requests_total", outcome=o) for o in ("stop", "length"))

    def run(i: int):
        chunks = list(client.stream(PROMPTS[i], **SETTINGS[i]))
        return chunks, client.generate(PROMPTS[i], **SETTINGS[i])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))

    for (chunks, whole), settings in zip(results, SETTINGS, strict=True):
        final = chunks[-1]
        assert final.finish_reason in ("stop", "length")
        assert all(not c.finish_reason for c in chunks[:-1])
        # Streamed deltas add up to the one-shot completion of the same (seeded) request.
        assert "".join(c.text for c in chunks) == whole.text
        assert 0 < final.completion_tokens <= settings["max_tokens"]
        assert 0 < final.steps <= settings["steps"]
        assert final.prompt_tokens > 0
    # request metrics follow each final response, step figures the last one: settled first
    steps = settled("dlm_rows_per_step_count") - count0
    multi_row_steps = steps - (metric("dlm_rows_per_step_bucket", le="1") - single0)
    assert steps > 0 and multi_row_steps > 0, "no engine step held more than one row"
    after = {n: metric(n) for n in names}
    assert (
        after["dlm_request_latency_seconds_count"] - before["dlm_request_latency_seconds_count"]
        == 16
    )
    assert after["dlm_steps_per_request_count"] - before["dlm_steps_per_request_count"] == 16
    assert (
        after["dlm_step_duration_seconds_count"] - before["dlm_step_duration_seconds_count"]
        == steps
    )
    tokens = sum(2 * chunks[-1].completion_tokens for chunks, _ in results)
    assert after["dlm_generated_tokens_total"] - before["dlm_generated_tokens_total"] == tokens
    finished = sum(metric("dlm_requests_total", outcome=o) for o in ("stop", "length"))
    assert finished - finished0 == 16


def test_http_generate_stream_with_plain_http(client: DLMClient, triton_server) -> None:
    settings = {"max_tokens": 16, "steps": 8}
    body = {
        "text_input": "Hello there",
        "stream": True,
        "sampling_parameters": json.dumps(settings),
    }
    events = []
    with httpx.stream("POST", triton_server.urls["generate_stream"], json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert events and events[-1]["finish_reason"] in ("stop", "length")
    text = "".join(e["text_output"] for e in events)
    assert text == client.generate("Hello there", **settings).text
    # Sampling keys as top-level request parameters work too.
    plain = {"text_input": "Hello there", **settings}
    r = httpx.post(triton_server.urls["generate_stream"], json=plain, timeout=120)
    last = json.loads([x for x in r.text.splitlines() if x.startswith("data: ")][-1][6:])
    assert last["text_output"] == text
    # Non-streaming requests send exactly one response, so plain /generate works as well.
    url = triton_server.urls["generate_stream"].removesuffix("_stream")
    one = httpx.post(url, json={"text_input": "Hello there", **settings}, timeout=120).json()
    assert (one["text_output"], one["finish_reason"]) == (text, last["finish_reason"])


def test_cli_generate_over_grpc_and_http(triton_server, capsys) -> None:
    from dlm_triton.launch.cli import main

    common = ["--model", triton_server.model_name, "--raw", "--max-tokens", "8", "--steps", "4"]
    assert main(["generate", "Hello", "--url", triton_server.urls["grpc"], *common]) == 0
    grpc_text = capsys.readouterr().out
    http = ["--http", "--http-url", triton_server.urls["http"], "--stream"]
    assert main(["generate", "Hello", *http, *common]) == 0
    assert capsys.readouterr().out == grpc_text
    assert (
        main(
            [
                "generate",
                "Hello",
                "--url",
                triton_server.urls["grpc"],
                *common,
                "--param",
                "algorithm=nope",
            ]
        )
        == 2
    )
    assert "invalid request: algorithm" in capsys.readouterr().err


def test_outputs_equal_the_engines_own(client: DLMClient, tiny_checkpoint: Path) -> None:
    from dlm_engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(tiny_checkpoint), device="cpu"))
    cases = [
        ({"text": "Hello there"}, {"prompt": "Hello there"}, {"max_tokens": 16, "steps": 16}),
        (
            {"messages": [{"role": "user", "content": "2+2?"}]},
            {"messages": [{"role": "user", "content": "2+2?"}]},
            {"max_tokens": 24, "steps": 12, "block_length": 8},
        ),
        ({"input_ids": [5, 6, 7, 8]}, {"input_ids": [5, 6, 7, 8]}, {"max_tokens": 8, "steps": 8}),
        (
            {"text": "seeded"},
            {"prompt": "seeded"},
            {"max_tokens": 16, "temperature": 0.8, "seed": 7},
        ),
        # accelerated rules through Triton's sampling_parameters, seeds' names too
        (
            {"text": "Sort: 5 3 9 1"},
            {"prompt": "Sort: 5 3 9 1"},
            {
                "max_tokens": 32,
                "steps": 32,
                "use_local_leap": True,
                "local_leap_anchor_threshold": 0.5,
                "force_single_batch": True,
            },
        ),
        (
            {"text": "Reverse abc"},
            {"prompt": "Reverse abc"},
            {"max_tokens": 32, "block_size": 8, "multi_block": True, "threshold": 0.3},
        ),
        ({"text": "copy x"}, {"prompt": "copy x"}, {"max_tokens": 16, "factor": 1.0}),
    ]
    for i, (encode_kw, client_kw, settings) in enumerate(cases):
        ids = engine.encode_prompt(**encode_kw)
        engine.add_request(f"ref-{i}", ids, SamplingParams.from_dict(settings))
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final = out
        got = client.generate(**client_kw, **settings)
        assert final is not None
        assert (got.text, got.finish_reason) == (final.text, final.finish_reason)
        assert (got.completion_tokens, got.steps, got.prompt_tokens) == (
            final.completion_tokens,
            final.steps,
            final.prompt_tokens,
        )


def test_cancellation_frees_the_row(client: DLMClient, metric) -> None:
    aborted0 = metric("dlm_requests_total", outcome="abort")
    stream = client.stream("a long one", **LONG_RUNNING)
    assert not next(stream).final  # running: denoise mode answers every step
    deadline = time.monotonic() + 30  # the gauge is read from Triton's metrics endpoint
    while metric("dlm_requests_in_flight") != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric("dlm_requests_in_flight") == 1
    stream.close()  # cancels the request's gRPC call: a client cancel

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            metric("dlm_requests_total", outcome="abort") > aborted0
            and metric("dlm_requests_in_flight") == 0
        ):
            break
        time.sleep(0.1)
    assert metric("dlm_requests_total", outcome="abort") == aborted0 + 1
    assert metric("dlm_requests_in_flight") == 0
    steps = metric("dlm_rows_per_step_count")
    time.sleep(STEP_METRICS_EVERY_S + 0.5)  # step figures are recorded at least this often
    assert metric("dlm_rows_per_step_count") == steps, "the engine still steps the aborted row"
    after = client.generate("still alive?", max_tokens=8, steps=8)
    assert after.finish_reason in ("stop", "length")


def _raw_stream(url: str, model: str, arrays: dict[str, np.ndarray], params: dict | None = None):
    """Send one request with arbitrary tensors; return ('ok', text) or ('error', message)."""
    types = {np.object_: "BYTES", np.int64: "INT64", np.bool_: "BOOL", np.float32: "FP32"}
    done = threading.Event()
    outcome: list = []

    def callback(result=None, error=None) -> None:
        if error is not None:
            outcome.append(("error", str(error.message() if hasattr(error, "message") else error)))
            done.set()
            return
        reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
        if reason:
            outcome.append(("ok", result.as_numpy("text_output").reshape(-1)[0].decode()))
            done.set()

    triton = grpcclient.InferenceServerClient(url)
    triton.start_stream(callback=callback)
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), types[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    triton.async_stream_infer(model, inputs, parameters=params)
    assert done.wait(120), f"no final response for {list(arrays)}"
    triton.stop_stream()
    triton.close()
    return outcome[0]


def _b(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


MALFORMED = {
    "no prompt": ({"stream": np.array([[True]])}, None, "exactly one of"),
    "two prompts": (
        {"text_input": _b("a"), "messages": _b('[{"role":"user","content":"a"}]')},
        None,
        "exactly one of",
    ),
    "messages not JSON": ({"messages": _b("{nope")}, None, "messages"),
    "messages not a list": ({"messages": _b('{"role": "user"}')}, None, "messages"),
    "message without content": ({"messages": _b('[{"role": "user"}]')}, None, "content"),
    "sampling not JSON": (
        {"text_input": _b("a"), "sampling_parameters": _b("{x")},
        None,
        "sampling_parameters",
    ),
    "sampling not an object": (
        {"text_input": _b("a"), "sampling_parameters": _b("[1]")},
        None,
        "sampling_parameters",
    ),
    "unknown key": ({"text_input": _b("a")}, {"warp_speed": 9}, "warp_speed"),
    "negative max_tokens": (
        {"text_input": _b("a"), "sampling_parameters": _b('{"max_tokens": -4}')},
        None,
        "max_tokens",
    ),
    "unknown algorithm": (
        {"text_input": _b("a"), "sampling_parameters": _b('{"algorithm": "magic"}')},
        None,
        "algorithm",
    ),
    "temperature not a number": ({"text_input": _b("a")}, {"temperature": "hot"}, "temperature"),
    "negative token id": ({"input_ids": np.array([[3, -1]], dtype=np.int64)}, None, "input_ids"),
    "batch of two": ({"input_ids": np.array([[3, 4], [5, 6]], dtype=np.int64)}, None, "input_ids"),
    "empty prompt": ({"text_input": _b("")}, None, "text_input"),
}


def test_malformed_requests_get_clear_errors_while_a_good_one_completes(
    client: DLMClient, triton_server
) -> None:
    url, model = triton_server.urls["grpc"], triton_server.model_name
    with ThreadPoolExecutor(6) as pool:
        good = pool.submit(client.generate, "good request", max_tokens=32, steps=32)
        bad = {k: pool.submit(_raw_stream, url, model, a, p) for k, (a, p, _) in MALFORMED.items()}
        for name, future in bad.items():
            kind, message = future.result(timeout=120)
            assert kind == "error", f"{name}: accepted"
            assert message.startswith("invalid request: "), f"{name}: {message}"
            assert MALFORMED[name][2] in message, f"{name}: {message}"
        assert good.result(timeout=120).finish_reason in ("stop", "length")
    with pytest.raises(DLMError) as info:
        client.generate("a", max_tokens="many")
    assert info.value.invalid


def test_committed_repository_model_serves_with_env_overrides(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """``model_repository/tiny-dlm`` itself (its CPU config and shim), the checkpoint given
    through DLM_CHECKPOINT as ``dlm-triton serve --model tiny-dlm`` would pass it."""
    from dlm_triton.launch.launcher import Ports, TritonServerProcess

    server = TritonServerProcess(
        "tiny-dlm",
        device="cpu",
        engine_params={"checkpoint": str(tiny_checkpoint), "max_rows": "4", "max_queue": "2"},
        ports=Ports.free(),
        log_path=tmp_path / "triton.log",
        exit_timeout_s=5,
    )
    with server:
        assert server.model_name == "tiny-dlm"
        assert server.choice.env["DLM_CHECKPOINT"] == str(tiny_checkpoint)
        client = DLMClient(server.urls["grpc"], "tiny-dlm")
        assert client.generate("hi", max_tokens=8, steps=4).finish_reason in ("stop", "length")
        # max_queue=2: a third request while two are generating is refused, not queued. On a
        # fast machine a long request may finish before the third arrives: then (and only
        # then) the attempt is repeated.
        for _attempt in range(3):
            running = [client.stream(f"long {i}", **LONG_RUNNING) for i in range(2)]
            for stream in running:
                next(stream)  # started (denoise answers every step)
            try:
                client.generate("one too many", max_tokens=8)
            except DLMError as exc:
                assert str(exc).startswith("overloaded: "), exc
                refused = True
            else:
                refused = False
                finals = [[c for c in stream if c.final] for stream in running]
                assert any(f and f[-1].finish_reason != "abort" for f in finals), (
                    "accepted while both long requests were still running"
                )
            for stream in running:
                stream.close()  # cancels on the server
            if refused:
                break
        assert refused
    assert "max_rows=4" in (tmp_path / "triton.log").read_text()


def test_ready_line_says_the_dtype_the_model_chose_and_why(
    triton_server, tiny_checkpoint: Path
) -> None:
    """The launcher's ready line reads the model's own ``dlm_model_info`` metric: the dtype
    the loaded instance runs in and why, the same as the loader's rule gives."""
    from dlm_engine.loader import choose_dtype

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    want_dtype, want_reason = choose_dtype("auto", config, "cpu")
    described = json.loads(triton_server.describe())
    assert described["dtype"] == want_dtype
    assert described["dtype_reason"] == want_reason
    assert described["device"] == "cpu" and int(described["torch_threads"]) >= 1
    # the weights' bytes on the device: float32 on CPU, as the checkpoint stores them
    index = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())
    stored = index["metadata"]["total_size"]
    assert described["quantization"] == "none"
    assert 0.9 * stored <= int(described["weight_bytes"]) <= 1.1 * stored
