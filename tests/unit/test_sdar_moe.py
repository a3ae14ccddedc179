"""SDAR-MoE (SDAR-30B-A3B): detected from its published config, its MoE layer equal to
transformers' Qwen3-MoE block on the same weights, the engine's tokens equal to SDAR's
published loop (dlm_lab/reference_block.py) at temperature 0 alone and batched with unlike
rows, and tensor parallel / expert parallel on 2 CPU ranks equal to one device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from block_checks import check_alone_and_batched

from dlm_engine import Engine, EngineConfig
from dlm_engine.models import SDAR, SDAR_MOE, build_model, detect_family
from dlm_engine.models.sdar_moe import SDARMoeArch, SDARMoeSparseMoe
from dlm_engine.parallel import ParallelLM
from dlm_lab import testing

# JetLM/SDAR-30B-A3B-Chat config.json: Qwen3-30B-A3B's shape plus SDAR's block keys
PUBLISHED_30B = {
    "architectures": ["SDARMoeForCausalLM"],
    "model_type": "sdar_moe",
    "block_size": 4,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "mask_token_id": 151669,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
PROMPTS = ["Hello there", "abc", "What is 2+2? Tell me more."]
CASES = [
    {"max_tokens": 13, "block_length": 4, "steps": 4},  # dynamic, threshold 0.85 (defaults)
    {"max_tokens": 16, "block_length": 4, "steps": 2, "algorithm": "low_confidence_static"},
    {"max_tokens": 12, "block_length": 8, "steps": 4, "algorithm": "sequential"},
    {"max_tokens": 10, "block_length": 4, "algorithm": "entropy_bounded", "threshold": 2.0},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    # layer 0 dense (`mlp_only_layers`), layers 1 and 2 routed: both MLP kinds in one model
    path = tmp_path_factory.mktemp("sdar_moe") / "m"
    return str(
        testing.make_tiny_checkpoint(
            path, "sdar_moe", seed=2, num_hidden_layers=3, mlp_only_layers=[0]
        )
    )


def test_published_config_is_sdar_moe_and_builds_30b_a3b() -> None:
    assert detect_family(PUBLISHED_30B) is SDAR_MOE
    assert detect_family({"model_type": "sdar", "architectures": ["SDARForCausalLM"]}) is SDAR
    a = SDARMoeArch.from_config(PUBLISHED_30B)
    assert (a.num_experts, a.num_experts_per_tok, a.norm_topk_prob) == (128, 8, True)
    assert all(a.is_sparse(i) for i in range(48))
    with torch.device("meta"):
        model = build_model(SDAR_MOE, PUBLISHED_30B)
    total = sum(p.numel() for p in model.parameters())
    assert 30.0e9 < total < 31.0e9  # 30.5B, as published
    names = dict(model.named_parameters())
    for n in (
        "model.layers.0.mlp.gate.weight",
        "model.layers.47.mlp.experts.127.down_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "lm_head.weight",
    ):
        assert n in names
    with pytest.raises(ValueError, match="num_experts"):
        SDARMoeArch.from_config({**PUBLISHED_30B, "num_experts": 0})


def test_tiny_checkpoint_has_the_published_layout(ckpt: str) -> None:
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    assert cfg["model_type"] == "sdar_moe" and cfg["architectures"] == ["SDARMoeForCausalLM"]
    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in index
    assert "model.layers.1.mlp.gate.weight" in index
    assert "model.layers.0.mlp.down_proj.weight" in index  # the dense layer
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in index)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_moe_layer_equals_transformers_qwen3_moe_block(norm_topk_prob: bool, fused: bool) -> None:
    """Same weights, float32: the published routing (softmax, top-k, optional renormalising)
    and the experts' weighted sum, before and after stacking the experts."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = {**PUBLISHED_30B, "hidden_size": 32, "num_experts": 8, "num_experts_per_tok": 3}
    cfg.update(moe_intermediate_size=16, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    ours = SDARMoeSparseMoe(SDARMoeArch.from_config(cfg))
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.3)
    theirs = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(**{k: cfg[k] for k in cfg if k != "architectures"})
    )
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        for e, expert in enumerate(ours.experts):
            theirs.experts.gate_up_proj[e].copy_(
                torch.cat((expert.gate_proj.weight, expert.up_proj.weight))
            )
            theirs.experts.down_proj[e].copy_(expert.down_proj.weight)
    if fused:
        ours.fuse()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_engine_equals_sdar_reference_alone_and_batched(ckpt: str) -> None:
    engine = Engine(EngineConfig(model=ckpt, device="cpu"))
    assert engine.loaded.family is SDAR_MOE
    assert type(engine.loaded.model.model.layers[1].mlp) is SDARMoeSparseMoe
    prompts = [engine.encode_prompt(text=t) for t in PROMPTS]
    check_alone_and_batched(
        engine, [(p, c) for c in CASES for p in prompts], testing.block_reference, past=4
    )


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_equal_one_device(ckpt: str, expert_parallel: bool, one_thread_per_rank) -> None:
    one = Engine(EngineConfig(model=ckpt))
    two = Engine(EngineConfig(model=ckpt, tensor_parallel_size=2, expert_parallel=expert_parallel))
    model = two.runner.model
    try:
        assert isinstance(model, ParallelLM) and len(model.workers.pids) == 1
        moe = model.local.model.layers[1].mlp
        if expert_parallel:  # 4 of 8 experts, whole
            assert moe.first_expert == 0 and moe.w_gate_up.shape[0] == 4
            assert (
                moe.w_gate_up.shape[1:] == one.runner.model.model.layers[1].mlp.w_gate_up.shape[1:]
            )
        else:  # every expert, half of its intermediate size
            assert moe.first_expert is None and moe.w_gate_up.shape[0] == 8
            assert moe.w_down.shape[1] * 2 == one.runner.model.model.layers[1].mlp.w_down.shape[1]
        prompts = [one.encode_prompt(text=t) for t in PROMPTS]
        rows = [CASES[0], CASES[2], CASES[1]]

        def tokens(engine: Engine, ps, params) -> list[list[int]]:
            return [o.token_ids for o in engine.generate(ps, params)]

        assert tokens(two, prompts[:1], rows[0]) == tokens(one, prompts[:1], rows[0])
        assert tokens(two, prompts, rows) == tokens(one, prompts, rows)
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)  # every worker reaped


def test_fp8_keeps_the_router_and_equals_the_reference(ckpt: str) -> None:
    """FP8 (dequantized on CPU) quantizes the stacked experts and the dense layers, never the
    router, and the engine still equals the loop on its own (quantized) model."""
    from dlm_engine.fp8 import Fp8Experts

    engine = Engine(EngineConfig(model=ckpt, device="cpu", quantization="fp8"))
    moe = engine.loaded.model.model.layers[1].mlp
    assert isinstance(moe.w_gate_up, Fp8Experts) and moe.gate.weight.dtype == torch.float32
    prompt = engine.encode_prompt(text=PROMPTS[2])
    for case in CASES[:2]:
        ref = testing.block_reference(engine, prompt, case)
        assert engine.generate([prompt], case)[0].token_ids == ref


def test_logits_equal_transformers_qwen3_moe_with_block_causal_mask(ckpt: str) -> None:
    """The whole model, read from the tiny checkpoint, against transformers' own
    Qwen3MoeForCausalLM given the same weights (its experts stacked as it stores them) and
    SDAR's block-causal mask: the published forward, dense layer and routed layers alike."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    from dlm_engine.loader import load_checkpoint
    from dlm_engine.models.common import ForwardBatch

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    hf_keys = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "model_type")}
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_keys)).eval()
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        state.update(load_file(str(f)))
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts."
        if f"{pre}0.gate_proj.weight" not in state:
            continue
        n = cfg["num_experts"]
        parts = [
            [state.pop(f"{pre}{e}.{p}_proj.weight") for e in range(n)]
            for p in ("gate", "up", "down")
        ]
        state[f"{pre}gate_up_proj"] = torch.stack(
            [torch.cat((g, u)) for g, u in zip(parts[0], parts[1], strict=True)]
        )
        state[f"{pre}down_proj"] = torch.stack(parts[2])
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert missing == [] and unexpected == []
    ours = load_checkpoint(Path(ckpt)).model

    b, t, block = 2, 13, 4  # the last block is partial
    ids = torch.randint(0, cfg["vocab_size"], (b, t), generator=torch.Generator().manual_seed(0))
    blk = torch.arange(t) // block
    mask = (blk[None, :] <= blk[:, None])[None].expand(b, t, t)
    pos = torch.arange(t)[None].expand(b, t)
    additive = torch.zeros(b, 1, t, t).masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=additive, position_ids=pos).logits
        got = ours(ForwardBatch(ids, pos, mask, None))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
