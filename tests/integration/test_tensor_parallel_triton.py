"""A tiny Dream checkpoint served by the real tritonserver with tensor_parallel_size 2 on the
CPU (gloo): the text equals the one-rank engine's, the worker rank runs beside the Triton
model process while it serves, and stopping the server leaves no worker behind."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from dlm_client import DLMClient, DLMError

from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_lab import testing

WORKER = b"dlm_engine.parallel.worker_main"


def _workers_of(checkpoint: Path) -> list[int]:
    """PIDs of live worker ranks loading `checkpoint` (a unique temporary path)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if WORKER in cmd and str(checkpoint).encode() in cmd and state != "Z":
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def dream_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testing.make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "tiny-dream", "dream")


def test_dream_tp2_through_triton(server_factory, dream_checkpoint: Path) -> None:
    params = {"tensor_parallel_size": "2"}
    server = server_factory(dream_checkpoint, name="tiny-dream-tp", engine_params=params)
    assert len(_workers_of(dream_checkpoint)) == 1  # rank 1 beside the model process
    client = DLMClient(server.urls["grpc"], server.model_name, http_url=server.urls["http"])
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(dream_checkpoint), device="cpu"))
    keys = {"max_tokens": 16, "steps": 16}
    for text in ("2+2?", "Name a color, please."):
        got = client.generate(text, **keys)
        want = engine.generate([engine.encode_prompt(text=text)], keys)[0]
        assert got.text == want.text
        assert got.completion_tokens == want.completion_tokens
    server.stop()
    deadline = time.monotonic() + 15
    while _workers_of(dream_checkpoint) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _workers_of(dream_checkpoint) == []


def test_diffusion_gemma_expert_parallel_through_triton(server_factory, tmp_path: Path) -> None:
    """`expert_parallel` as a config parameter reaches the engine: DiffusionGemma, which
    serves over 2 ranks only with it (refused without), gives the one-device engine's text."""
    from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

    ckpt = make_tiny_diffusion_gemma(tmp_path / "tiny-dg-ep", canvas_length=16)
    params = {"tensor_parallel_size": "2", "expert_parallel": "true"}
    server = server_factory(ckpt, name="tiny-dg-ep", engine_params=params)
    assert len(_workers_of(ckpt)) == 1
    client = DLMClient(server.urls["grpc"], server.model_name, http_url=server.urls["http"])
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=str(ckpt), device="cpu"))
    keys = {"seed": 7, "max_tokens": 32, "stop_entropy": 0.3, "stability_threshold": 0}
    for text in ("Sort 4 2 9.", "Name a color, please."):
        got = client.generate(text, **keys)
        want = engine.generate([engine.encode_prompt(text=text)], keys)[0]
        assert want.completion_tokens > 0
        assert got.text == want.text
        assert got.completion_tokens == want.completion_tokens
    server.stop()
    deadline = time.monotonic() + 15
    while _workers_of(ckpt) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _workers_of(ckpt) == []


def test_a_killed_worker_rank_restarts_the_model(server_factory, dream_checkpoint: Path) -> None:
    """kill -9 of the worker rank while a request runs: that request ends with an error naming
    the rank, the model process exits (Triton's model goes not ready), the supervisor restarts
    the server with a new group, which answers as before, and no rank is left behind."""
    params = {"tensor_parallel_size": "2"}
    server = server_factory(dream_checkpoint, name="tiny-dream-tp-kill", engine_params=params)
    server.supervise()
    client = DLMClient(server.urls["grpc"], server.model_name, http_url=server.urls["http"])
    keys = {"max_tokens": 16, "steps": 16}
    expected = client.generate("2+2?", **keys).text
    (worker,) = _workers_of(dream_checkpoint)
    long = {"max_tokens": 512, "steps": 512, "suppress_eos": True}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: client.generate("Count.", **long))
        time.sleep(2.0)  # in flight
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(DLMError, match=rf"worker rank 1 \(pid {worker}\) exited"):
            running.result(timeout=60)
    assert time.monotonic() - killed_at < 30
    deadline = time.monotonic() + 180
    while server.restarts < 1 or not server.restart_log:
        assert time.monotonic() < deadline, "the supervisor never restarted the model"
        time.sleep(0.2)
    assert "died" in str(server.restart_log[-1]["reason"])
    assert client.generate("2+2?", **keys).text == expected  # a new group, same answer
    (new_worker,) = _workers_of(dream_checkpoint)
    assert new_worker != worker
    server.stop()
    deadline = time.monotonic() + 15
    while _workers_of(dream_checkpoint) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _workers_of(dream_checkpoint) == []
