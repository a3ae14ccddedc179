"""The committed model repository, the request parser and the tritonserver assembly (no server)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from dlm_triton.backend.request_parse import RequestError, parse_request
from dlm_triton.backend.settings import resolve_settings
from dlm_triton.launch import model_repo
from dlm_triton.launch.server_dist import TritonNotFoundError, find_server, python_tag

EXPECTED_MODELS = {
    "tiny-dlm",
    "diffusiongemma-26b-a4b-it",
    "tiny-sdar",
    "llada-8b-instruct",
    "llada-1.5",
    "dream-v0-instruct-7b",
    "d3llm-llada",
    "d3llm-dream",
    # block-diffusion models
    "llada2-mini",
    "llada2.1-mini",
    "sdar-4b-chat",
    "sdar-8b-chat",
    "sdar-30b-a3b-chat",
    "fast-dllm-v2-7b",
    # flagships: tensor (and expert) parallel over 4 GPUs
    "llada2-flash",
    "llada2.1-flash",
}


def test_committed_repository_matches_the_template() -> None:
    assert model_repo.diff_repository() == [], "run: python -m dlm_triton.launch.model_repo"
    folders = {p.name for p in model_repo.COMMITTED_REPOSITORY.iterdir() if p.is_dir()}
    assert folders == EXPECTED_MODELS


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS))
def test_model_folder_follows_the_contract(name: str) -> None:
    folder = model_repo.COMMITTED_REPOSITORY / name
    gpu = (folder / "config.pbtxt").read_text()
    cpu = (folder / "configs" / "config_cpu.pbtxt").read_text()
    assert "kind: KIND_GPU" in gpu and "kind: KIND_CPU" in cpu
    for text in (gpu, cpu):
        assert f'name: "{name}"' in text
        assert 'backend: "python"' in text
        assert "decoupled: true" in text
        # one request an execute(): the load board steers each one (instance_load.py)
        assert "dynamic_batching" not in text
        for tensor in ("text_input", "messages", "input_ids", "stream", "sampling_parameters"):
            assert re.search(rf'name: "{tensor}" .* optional: true', text), tensor
        for tensor in (
            "text_output",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "steps",
            "canvas",
        ):
            assert f'name: "{tensor}"' in text
        assert 'key: "checkpoint"' in text
    shim = (folder / "1" / "model.py").read_text()
    assert "from dlm_triton.backend.triton_model import TritonPythonModel" in shim
    assert len([line for line in shim.splitlines() if line.strip()]) <= 3


def test_server_dist_assembles_a_backend_for_this_python(tmp_path) -> None:
    try:
        dist = find_server(cache=tmp_path)
    except TritonNotFoundError:
        pytest.skip("no tritonserver available")
    stub = dist.backend_dir / "python" / "triton_python_backend_stub"
    assert os.access(dist.binary, os.X_OK)
    if dist.source == "wheel":
        assert os.access(stub, os.X_OK)
        assert (dist.backend_dir / "python" / "libtriton_python.so").exists()
        assert f"/{python_tag()}/" not in str(stub)  # copied out of python_backend_stubs/
        assert "nvidia_pytriton.libs" in dist.env["LD_LIBRARY_PATH"]
    cmd = dist.command(tmp_path, http_port=1, grpc_port=2, metrics_port=3, models=["m"])
    assert "--load-model=m" in cmd and f"--backend-directory={dist.backend_dir}" in cmd


def _bytes(value: str) -> np.ndarray:
    return np.array([[value.encode()]], dtype=np.object_)


def test_parse_merges_parameters_and_tensor_wins() -> None:
    parsed = parse_request(
        {
            "text_input": _bytes("hi"),
            "stream": np.array([[True]]),
            "sampling_parameters": _bytes(json.dumps({"steps": 4, "max_tokens": 8})),
        },
        json.dumps({"steps": 2, "temperature": 0.5, "triton_enable_empty_final_response": True}),
    )
    assert parsed.prompt_kind == "text_input" and parsed.prompt == "hi" and parsed.stream
    assert parsed.sampling == {"steps": 4, "temperature": 0.5, "max_tokens": 8}


@pytest.mark.parametrize(
    "inputs, params",
    [
        ({}, None),
        ({"text_input": _bytes("a"), "messages": _bytes("[]")}, None),
        ({"messages": _bytes("not json")}, None),
        ({"messages": _bytes('[{"role": "user"}]')}, None),
        ({"input_ids": np.array([[1, -2]], dtype=np.int64)}, None),
        ({"input_ids": np.array([[1, 2], [3, 4]], dtype=np.int64)}, None),
        ({"text_input": _bytes("a"), "sampling_parameters": _bytes("[1]")}, None),
        ({"text_input": _bytes("a")}, "{not json"),
        ({"text_input": _bytes("")}, None),
    ],
)
def test_parse_rejects_with_the_stable_prefix(inputs, params) -> None:
    with pytest.raises(RequestError, match=r"^invalid request: "):
        parse_request(inputs, params)


def test_env_overrides_config_parameters() -> None:
    s = resolve_settings(
        {"checkpoint": "x", "dtype": "auto", "max_rows": "4"},
        kind="GPU",
        device_id=1,
        environ={"DLM_DTYPE": "bfloat16", "DLM_MAX_ROWS": "8"},
    )
    assert (s.dtype, s.max_rows, s.device, s.model) == ("bfloat16", 8, "cuda:1", "x")


def test_kv_pool_settings_parse_and_default_to_the_engine() -> None:
    """Block-diffusion pool keys: config parameter or env, typed; unset stays unset (the
    engine's own default); a bad value names the key."""
    s = resolve_settings(
        {"checkpoint": "x", "kv_cache_tokens": "4096"},
        environ={"DLM_KV_CACHE_MEMORY_FRACTION": "0.3", "DLM_PREFIX_CACHE_TOKENS": "0"},
    )
    assert (s.kv_cache_tokens, s.kv_cache_memory_fraction, s.prefix_cache_tokens) == (
        4096,
        0.3,
        0,
    )
    unset = resolve_settings({"checkpoint": "x"}, environ={})
    assert not unset.configured("kv_cache_tokens")
    assert not unset.configured("kv_cache_memory_fraction")
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        resolve_settings({"checkpoint": "x", "kv_cache_memory_fraction": "half"}, environ={})


def test_scheduling_settings_reach_the_engine_config() -> None:
    """phase_wait_steps, cuda_graph_max_tokens, the admission window: parameter or env, typed,
    unset = the engine's default; every setting is an EngineConfig field."""
    from dataclasses import fields

    from dlm_engine import EngineConfig
    from dlm_protocol.settings import SETTINGS

    s = resolve_settings(
        {"checkpoint": "x", "phase_wait_steps": "0"},
        environ={"DLM_CUDA_GRAPH_MAX_TOKENS": "1024"},
    )
    assert (s.phase_wait_steps, s.cuda_graph_max_tokens) == (0, 1024)
    s = resolve_settings(
        {"checkpoint": "x", "admission_window_ms": "12.5", "admission_burst_gap_ms": "30"},
        environ={"DLM_ADMISSION_GAP_MS": "0"},
    )
    assert (s.admission_window_ms, s.admission_gap_ms, s.admission_burst_gap_ms) == (
        12.5,
        0.0,
        30.0,
    )
    s = resolve_settings({"checkpoint": "x"}, environ={"DLM_ADMISSION_BURST_GAP_MS": "55"})
    assert s.admission_burst_gap_ms == 55.0
    unset = resolve_settings({"checkpoint": "x"}, environ={})
    default = EngineConfig(model="x")
    for name in ("phase_wait_steps", "cuda_graph_max_tokens", "admission_window_ms"):
        assert not unset.configured(name) and getattr(unset, name) == getattr(default, name)
    assert not unset.configured("admission_gap_ms")
    assert not unset.configured("admission_burst_gap_ms")
    with pytest.raises(ValueError, match="admission_burst_gap_ms"):
        EngineConfig(model="x", admission_burst_gap_ms=-5)
    with pytest.raises(ValueError, match="admission_gap_ms"):
        resolve_settings({"checkpoint": "x", "admission_gap_ms": "soon"}, environ={})
    with pytest.raises(ValueError, match="admission_window_ms"):
        EngineConfig(model="x", admission_window_ms=-1)
    assert [s.name for s in SETTINGS] == [f.name for f in fields(EngineConfig)]
    with pytest.raises(ValueError, match="phase_wait_steps"):
        resolve_settings({"checkpoint": "x", "phase_wait_steps": "many"}, environ={})
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        EngineConfig(model="x", cuda_graph_max_tokens=-1)


def test_checkpoint_names_resolve_to_embedded_assets(tmp_path) -> None:
    from dlm_protocol.settings import ASSETS_DIR, resolve_checkpoint

    if (ASSETS_DIR / "tiny-dlm").is_dir():
        assert resolve_checkpoint("tiny-dlm") == str((ASSETS_DIR / "tiny-dlm").resolve())
    (tmp_path / "ckpt").mkdir()
    assert resolve_checkpoint("ckpt", model_dir=tmp_path) == str(tmp_path / "ckpt")
    assert resolve_checkpoint("GSAI-ML/LLaDA-8B-Instruct") == "GSAI-ML/LLaDA-8B-Instruct"


def test_max_batch_size_follows_a_max_rows_override() -> None:
    """A burst of max_rows requests must reach the engine in one execute() call."""
    spec = model_repo.ModelSpec("m", "ckpt", max_rows="32")
    assert "max_batch_size: 32" in model_repo.render_config(spec, "KIND_CPU")
    assert "max_batch_size: 16" in model_repo.render_config(
        model_repo.ModelSpec("m", "c"), "KIND_CPU"
    )
