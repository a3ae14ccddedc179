"""A tiny Dream checkpoint served by the real tritonserver with tensor_parallel_size 2 on the
CPU (gloo): the text equals the one-rank engine's, the worker rank runs beside the Triton
model process while it serves, and stopping the server leaves no worker behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from dlm_client import DLMClient

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
