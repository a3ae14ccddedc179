"""LLaDA2.0-flash / LLaDA2.1-flash: the mini's BailingMoeV2 layout at flagship size, served by
the LLaDA2 family. The published architecture builds at ~103B parameters; a tiny checkpoint
with the flash config's keys (its extra, unused ones included) and other expert / group
counts than the mini's loads, equals LLaDA2's published loop at temperature 0 alone and
batched with unlike rows, and gives one device's tokens with its experts spread over 2
ranks (the model_repository entries spread them over 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from block_checks import check_alone_and_batched

from dlm_engine import Engine, EngineConfig
from dlm_engine.models import LLADA2, build_model, detect_family
from dlm_engine.models.llada2 import LLaDA2Arch
from dlm_engine.parallel import ParallelLM
from dlm_engine.presets import PRESETS
from dlm_lab import testing
from dlm_triton.launch.model_repo import COMMITTED_REPOSITORY, read_parameters

# keys of the flash config.json beyond the mini's that the engine reads none of
FLASH_EXTRA_KEYS = {
    "max_position_embeddings": 16384,
    "rotary_dim": 64,
    "router_dtype": "fp32",
    "moe_router_enable_expert_bias": True,
    "using_split_qkv_in_self_attention": False,
    "use_rmsnorm": True,
    "norm_softmax": False,
    "max_window_layers": 28,
}
CASES = [
    {"max_tokens": 16, "block_length": 8, "steps": 8},  # threshold 0.95 (LLaDA2's default)
    {"max_tokens": 12, "block_length": 4, "steps": 2, "threshold": 0.2},
    {"max_tokens": 24},  # the model's own block: 32
]
PROMPTS = ["Hello there", "abc", "What is 2+2? Tell me more."]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 16 experts in 8 groups (the mini: 8 in 4), 4 a token from the 4 best groups, two dense
    # layers first
    path = testing.make_tiny_checkpoint(
        tmp_path_factory.mktemp("flash") / "m",
        "llada2",
        seed=4,
        num_hidden_layers=3,
        num_experts=16,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=4,
        moe_intermediate_size=16,
        first_k_dense_replace=2,
    )
    cfg_file = path / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **FLASH_EXTRA_KEYS}))
    return str(path)


def test_flash_preset_is_llada2_at_103b() -> None:
    cfg = PRESETS["llada2-flash"]
    assert detect_family(cfg) is LLADA2
    a = LLaDA2Arch.from_config(cfg)
    assert (a.num_hidden_layers, a.hidden_size, a.moe_intermediate_size) == (32, 4096, 1024)
    assert (a.num_experts, a.num_experts_per_tok, a.n_group, a.topk_group) == (256, 8, 8, 4)
    assert a.rotary_dim == FLASH_EXTRA_KEYS["rotary_dim"]  # head_dim 128 x 0.5, as published
    with torch.device("meta"):
        model = build_model(LLADA2, cfg)
    assert 100e9 < sum(p.numel() for p in model.parameters()) < 106e9


@pytest.mark.parametrize("name", ["llada2-flash", "llada2.1-flash"])
def test_model_repository_spreads_flash_over_4_gpus(name: str) -> None:
    params = read_parameters(COMMITTED_REPOSITORY / name / "config.pbtxt")
    assert params["tensor_parallel_size"] == "4" and params["expert_parallel"] == "true"
    assert (
        params["checkpoint"].startswith("inclusionAI/LLaDA2.") and "flash" in params["checkpoint"]
    )


def test_flash_keys_load_and_equal_llada2_reference_alone_and_batched(ckpt: str) -> None:
    engine = Engine(EngineConfig(model=ckpt, device="cpu"))
    assert engine.loaded.family is LLADA2
    layers = engine.loaded.model.model.layers
    assert layers[2].mlp.w_gate_up.shape[0] == 16 and not hasattr(layers[1].mlp, "w_gate_up")
    prompts = [engine.encode_prompt(text=t) for t in PROMPTS]
    check_alone_and_batched(
        engine, [(p, c) for c in CASES for p in prompts], testing.block_reference, past=4
    )


def test_flash_ep2_equals_one_device(ckpt: str, one_thread_per_rank) -> None:
    one = Engine(EngineConfig(model=ckpt))
    two = Engine(EngineConfig(model=ckpt, tensor_parallel_size=2, expert_parallel=True))
    model = two.runner.model
    try:
        assert isinstance(model, ParallelLM)
        moe = model.local.model.layers[2].mlp
        assert moe.first_expert == 0 and moe.w_gate_up.shape[0] == 8  # 8 of 16, whole
        prompts = [one.encode_prompt(text=t) for t in PROMPTS]

        def tokens(engine: Engine, ps, params) -> list[list[int]]:
            return [o.token_ids for o in engine.generate(ps, params)]

        assert tokens(two, prompts, CASES) == tokens(one, prompts, CASES)
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)  # every worker reaped


def test_checkpoint_names_are_the_minis(ckpt: str) -> None:
    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.15.down_proj.weight" in index
    assert "model.layers.2.mlp.gate.expert_bias" in index
    assert "model.layers.1.mlp.gate_proj.weight" in index  # first_k_dense_replace 2: dense
