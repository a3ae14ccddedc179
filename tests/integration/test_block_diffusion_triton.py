"""A block-diffusion model (SDAR layout, tiny random checkpoint) served by the real
tritonserver: the text equals the engine's own, the seeds' parameter names pass through
Triton, bad block-diffusion keys get an error naming the field, the KV page pool takes the
size configured for the model (reported by `dlm_model_info`), and the prefix cache's counters
move when two requests share a system prompt (its whole KV pages)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dlm_client import DLMClient, DLMError
from triton_metrics import read_metric, settled_metric

from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_lab import testing
from dlm_triton.launch.procs import http_text
from dlm_triton.launch.runtime_info import model_info

SYSTEM = "You are a careful assistant. Answer in one short line. "


@pytest.fixture(scope="module")
def sdar_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testing.make_tiny_checkpoint(tmp_path_factory.mktemp("sdar") / "tiny-sdar", "sdar")


def test_sdar_through_triton(server_factory, sdar_checkpoint: Path) -> None:
    pool = {"kv_cache_tokens": "4096", "prefix_cache_tokens": "1024"}
    server = server_factory(sdar_checkpoint, name="tiny-sdar", engine_params=pool)
    info = model_info(http_text(server.urls["metrics"]), server.model_name)
    assert (info["kv_pool_tokens"], info["kv_page_tokens"]) == ("4096", "16"), info
    assert info["prefix_cache"] == "on"
    client = DLMClient(server.urls["grpc"], server.model_name, http_url=server.urls["http"])
    engine = Engine(EngineConfig(model=str(sdar_checkpoint), device="cpu"))
    keys = {"max_tokens": 12, "remasking_strategy": "sequential", "denoising_steps": 2}
    for question in ("2+2?", "Name a color."):
        text = SYSTEM + question
        got = client.generate(text, **keys)
        want = engine.generate([engine.encode_prompt(text=text)], keys)[0]
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
    hits = settled_metric(server, "dlm_prefix_cache_hit_tokens_total")
    page = engine.runner.block_pages.pool.page_tokens  # the server's engine pages alike
    assert hits >= len(SYSTEM) // page * page  # the second request shared the whole pages
    assert read_metric(server, "dlm_prefix_cache_lookup_tokens_total") > hits
    with pytest.raises(DLMError) as err:
        client.generate("x", max_tokens=8, cache="dual")
    assert "cache" in str(err.value)
