"""``dlm-triton serve`` with a companion, as ``make serve`` runs it: the embedded default
``tiny-dlm`` and the embedded block-diffusion ``tiny-sdar`` of the committed repository in one
tritonserver, behind one OpenAI proxy, drained and stopped as one unit.

One server start (two models load on a 2-core CPU): readiness of both, gRPC generation from
each, the proxy's model list and a held-out question answered correctly by the block-diffusion
model through the proxy with the official ``openai`` client, a restart after the
second model's stub dies (both come back), then a stop with a request of each model still
generating: both models see the shared drain file, nothing is killed and no stub or shm
region is left.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
from dlm_client import DLMClient, DLMError

from dlm_lab.training import tasks
from dlm_triton.launch.launcher import DEFAULT_MODEL, Ports, TritonServerProcess
from dlm_triton.launch.procs import http_text
from dlm_triton.launch.runtime_info import model_info
from dlm_triton.launch.server_dist import TritonNotFoundError, find_server

pytestmark = pytest.mark.integration
COMPANION = "tiny-sdar"
# Still running when the stop comes (the short drain then aborts it): the regex admits only
# 500 'a's, so no end of text is committed early; one token per step.
LONG = {
    DEFAULT_MODEL: {"max_tokens": 512, "steps": 512, "stream_mode": "denoise", "regex": "a{500}"},
    COMPANION: {"max_tokens": 512, "algorithm": "low_confidence_static", "regex": "a{500}"},
}


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_default_model_and_companion_in_one_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        find_server()
    except TritonNotFoundError:
        pytest.skip("no tritonserver available")
    pytest.importorskip("openai_proxy.__main__")
    monkeypatch.delenv("DLM_MODEL_REPOSITORY", raising=False)  # the committed one
    monkeypatch.delenv("DLM_CHECKPOINT", raising=False)
    log = tmp_path / "triton.log"
    server = TritonServerProcess(
        None,  # the embedded default, as `dlm-triton serve` without --model
        also=[COMPANION],
        device="cpu",
        ports=Ports.free(),
        proxy=True,
        log_path=log,
        ready_timeout_s=300,
        exit_timeout_s=5,
        drain_timeout_s=0.5,
    )
    names = [DEFAULT_MODEL, COMPANION]
    with server:  # start() on entry, stop() on exit
        assert server.model_name == DEFAULT_MODEL and server.model_names == names
        assert server.urls["generate_stream"].endswith(
            f"/v2/models/{DEFAULT_MODEL}/generate_stream"
        )
        described = json.loads(server.describe())
        assert described["model"] == DEFAULT_MODEL and described["models"] == names
        metrics = http_text(server.urls["metrics"])
        for name in names:  # the launcher's env overrides reach both models
            assert model_info(metrics, name).get("device") == "cpu", name

        triton = grpcclient.InferenceServerClient(server.urls["grpc"])
        assert triton.is_server_ready()
        assert all(triton.is_model_ready(name) for name in names)
        stubs = server.stub_pids()
        assert len(stubs) == 2, stubs  # one Python stub per model
        assert server.shm_files()

        for name in names:
            client = DLMClient(server.urls["grpc"], name)
            result = client.generate("Hello", max_tokens=8)
            assert result.finish_reason in ("stop", "length"), name
            assert 0 < result.completion_tokens <= 8

        base = server.urls["openai"]
        deadline = time.monotonic() + 30
        while True:  # the proxy probes Triton's model list on its own schedule
            listed = [m["id"] for m in httpx.get(f"{base}/models", timeout=10).json()["data"]]
            if set(names) <= set(listed) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert set(names) <= set(listed), listed
        openai = pytest.importorskip("openai")
        question = next(e for e in tasks.heldout_examples(12) if e.task == "reverse")
        chat = openai.OpenAI(base_url=base, api_key="unused").chat.completions.create(
            model=COMPANION,
            messages=tasks.messages_for(question),
            max_tokens=32,
            temperature=0,
        )
        assert chat.model == COMPANION and chat.choices[0].finish_reason == "stop"
        assert chat.choices[0].message.content.strip() == question.answer

        # The companion's stub dies: the whole server comes back with both models (the one
        # restart the supervisor would make; called here to keep the test deterministic).
        companion_stub = next(
            pid for pid, cmd in server._stubs.items() if any(f"/{COMPANION}/" in a for a in cmd)
        )
        os.kill(companion_stub, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (reason := server.dead_reason()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reason == f"model stub {companion_stub} died", reason
        server.restart(reason)
        assert server.restarts == 1 and server.dead_reason() is None
        assert all(_gone(p) for p in stubs), "a stub of the first server outlived it"
        stubs = server.stub_pids()
        assert len(stubs) == 2 and all(triton.is_model_ready(name) for name in names)

        # A request of each model generating when the stop comes: both drain (shared file).
        started = threading.Barrier(len(names) + 1, timeout=120)
        ended: dict[str, str] = {}

        def generate(name: str) -> None:
            chunks = DLMClient(server.urls["grpc"], name).stream("a long one", **LONG[name])
            try:
                next(chunks)
                started.wait()
                ended[name] = [c.finish_reason for c in chunks][-1]
            except (DLMError, threading.BrokenBarrierError) as exc:
                ended[name] = f"error: {exc}"

        threads = [threading.Thread(target=generate, args=(n,)) for n in names]
        for t in threads:
            t.start()
        started.wait()
        pid, proxy_pid = server.server.pid, server.proxy.pid
        server.stop()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a client never saw its stream end"

    assert ended == dict.fromkeys(names, "abort"), ended  # both drained: aborted, not cut off
    report = server.last_stop
    assert report["drained"] and report["server_exit"] == 0, report
    assert report["server_killed"] is False and report["stubs_killed"] == 0, report
    text = log.read_text(errors="replace")
    for name in names:
        assert f"dlm model {name}: draining 1 requests" in text, f"{name} saw no drain file"
    assert _gone(pid) and _gone(proxy_pid)
    assert all(_gone(p) for p in stubs), "a stub outlived its server"
    assert server.stub_pids() == [] and server.shm_files() == []
