"""SDAR and LLaDA2: published layouts, block-causal attention, LLaDA2's routing and experts.

SDAR is checked against transformers' own Qwen3ForCausalLM loaded from the same weights (the
published SDAR modeling file is Qwen3's with block-causal masks); LLaDA2's MoE layer against
a per-token loop restating inclusionAI's `LLaDA2MoeGate` / `moe_infer`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dlm_engine.loader import _special_ids, load_checkpoint, random_checkpoint
from dlm_engine.models import DREAM, LLADA, LLADA2, SDAR, build_model, detect_family
from dlm_engine.models import moe as moe_mod
from dlm_engine.models.common import ForwardBatch
from dlm_engine.models.llada2 import LLaDA2Arch, LLaDA2SparseMoe
from dlm_engine.presets import PRESETS
from dlm_engine.tokenizer_build import build_char_tokenizer, vocab_size_for
from dlm_lab.testing import llada2_config, make_tiny_checkpoint, write_checkpoint


def block_causal(t: int, block: int, rows: int = 1) -> torch.Tensor:
    """[rows, T, T] True where key j's block is not after query i's block."""
    b = torch.arange(t) // block
    return (b[None, :] <= b[:, None])[None].expand(rows, t, t)


def logits(model, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        return model(ForwardBatch(ids, pos, mask, None))


def uneven_norms(path: Path) -> Path:
    """Rewrite the checkpoint with random RMS-norm weights: with all-equal ones (the tiny
    checkpoints' choice) per-head q/k norms commute with the rotary embedding and cannot tell
    q's norm from k's, so the comparisons below would not see such mistakes."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(7)
    for name, w in state.items():
        if name.endswith("norm.weight"):
            state[name] = w * (1 + 0.5 * torch.randn(w.shape, generator=gen))
    write_checkpoint(path, json.loads((path / "config.json").read_text()), state)
    return path


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 32 with hidden 64 and 4 heads: head_dim is its own key, not hidden / heads
    return uneven_norms(
        make_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), "sdar", seed=3, head_dim=32)
    )


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return uneven_norms(make_tiny_checkpoint(tmp_path_factory.mktemp("llada2"), "llada2", seed=3))


def test_families_detected_from_published_configs() -> None:
    assert detect_family({"model_type": "sdar", "architectures": ["SDARForCausalLM"]}) is SDAR
    assert detect_family({"architectures": ["SDARForCausalLM"]}) is SDAR
    assert detect_family({"model_type": "llada2_moe"}) is LLADA2
    assert detect_family({"architectures": ["LLaDA2MoeModelLM"]}) is LLADA2
    assert detect_family({"architectures": ["LLaDAModelLM"]}) is LLADA
    assert detect_family({"model_type": "Dream"}) is DREAM
    assert (SDAR.block_diffusion, SDAR.default_block_length) == (True, 4)
    assert (LLADA2.block_diffusion, LLADA2.default_block_length) == (True, 32)
    assert (LLADA.block_diffusion, LLADA.default_block_length) == (False, 0)
    assert (SDAR.mask_token, LLADA2.mask_token) == ("<|MASK|>", "<|mask|>")


# per-layer tensor names of JetAstra/SDAR training/model/SDAR-4B-Chat/model.safetensors.index.json
SDAR_LAYER = {
    "input_layernorm.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "post_attention_layernorm.weight",
    "self_attn.k_norm.weight",
    "self_attn.k_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.v_proj.weight",
}


def test_sdar_checkpoint_has_the_published_layout(sdar_dir: Path) -> None:
    names = set(json.loads((sdar_dir / "model.safetensors.index.json").read_text())["weight_map"])
    layers = {f"model.layers.{i}.{n}" for i in range(2) for n in SDAR_LAYER}
    assert names == layers | {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    cfg = json.loads((sdar_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["block_size"]) == (
        "sdar",
        ["SDARForCausalLM"],
        4,
    )
    lm = load_checkpoint(sdar_dir)
    assert lm.family is SDAR and lm.model.head_dim == 32 and lm.model.rope_theta == 1e6
    ids = json.loads((sdar_dir / "tokenizer.json").read_text())["added_tokens"]
    by_name = {t["content"]: t["id"] for t in ids}
    assert lm.mask_id == by_name["<|MASK|>"] == cfg["mask_token_id"]
    assert lm.stop_ids == {by_name["<|im_end|>"], by_name["<|endoftext|>"]}


@pytest.mark.parametrize("tied", [False, True])
def test_sdar_logits_equal_transformers_qwen3_with_block_causal_mask(
    sdar_dir: Path, tmp_path: Path, tied: bool
) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = sdar_dir
    if tied:
        path = uneven_norms(
            make_tiny_checkpoint(tmp_path, "sdar", seed=4, head_dim=32, tie_word_embeddings=True)
        )
    cfg = json.loads((path / "config.json").read_text())
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "attention_bias",
    )
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: cfg[k] for k in keys})).eval()
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if tied else [])
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ours = load_checkpoint(path).model

    b, t = 2, 13  # the last block of 4 is partial
    ids = torch.randint(0, cfg["vocab_size"], (b, t), generator=torch.Generator().manual_seed(0))
    mask = block_causal(t, 4, b)
    pos = torch.arange(t)[None].expand(b, t)
    additive = torch.zeros(b, 1, t, t).masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
    for impl in ("sdpa", "eager"):
        hf.config._attn_implementation = impl
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=additive, position_ids=pos).logits
        torch.testing.assert_close(logits(ours, ids, mask), ref, rtol=1e-5, atol=1e-4)
    # the mask matters: bidirectional attention gives other logits
    assert not torch.allclose(logits(ours, ids, None), ref, atol=1e-3)


def test_block_causal_logits_ignore_later_blocks(sdar_dir: Path, llada2_dir: Path) -> None:
    for path, block in ((sdar_dir, 4), (llada2_dir, 8)):
        model = load_checkpoint(path).model
        t = 3 * block
        ids = torch.randint(0, model.vocab_size, (1, t), generator=torch.Generator().manual_seed(1))
        changed = ids.clone()
        changed[0, 2 * block :] = (changed[0, 2 * block :] + 1) % model.vocab_size
        a, b = (
            logits(model, ids, block_causal(t, block)),
            logits(model, changed, block_causal(t, block)),
        )
        torch.testing.assert_close(a[:, : 2 * block], b[:, : 2 * block])
        assert not torch.allclose(a[:, 2 * block :], b[:, 2 * block :])


def test_llada2_checkpoint_has_the_published_layout(llada2_dir: Path) -> None:
    names = set(json.loads((llada2_dir / "model.safetensors.index.json").read_text())["weight_map"])
    attn = ["query_key_value", "query_layernorm", "key_layernorm", "dense"]
    common = {f"attention.{n}.weight" for n in attn} | {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    }
    mlp = ("gate_proj", "up_proj", "down_proj")
    dense = {f"mlp.{p}.weight" for p in mlp}
    sparse = {"mlp.gate.weight", "mlp.gate.expert_bias"}
    sparse |= {f"mlp.experts.{e}.{p}.weight" for e in range(8) for p in mlp}
    sparse |= {f"mlp.shared_experts.{p}.weight" for p in mlp}
    want = {"model.word_embeddings.weight", "model.norm.weight", "lm_head.weight"}
    for i, block in enumerate([dense, sparse, sparse]):  # first_k_dense_replace = 1
        want |= {f"model.layers.{i}.{n}" for n in common | block}
    assert names == want
    cfg = json.loads((llada2_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("llada2_moe", ["LLaDA2MoeModelLM"])
    lm = load_checkpoint(llada2_dir)
    by_name = lm.tokenizer.get_vocab()
    assert lm.family is LLADA2 and lm.mask_id == by_name["<|mask|>"]
    assert lm.stop_ids == {by_name["<|role_end|>"], by_name["<|endoftext|>"]}
    moe = lm.model.model.layers[1].mlp
    assert not hasattr(moe, "experts")  # replaced by the stacked weights for grouped GEMMs
    assert moe.w_gate_up.shape == (8, 64, 64) and moe.w_down.shape == (8, 32, 64)


def published_moe_loop(layer: LLaDA2SparseMoe, x: torch.Tensor) -> torch.Tensor:
    """inclusionAI's LLaDA2MoeGate + moe_infer, one token and one chosen expert at a time."""
    a = layer.a
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        scores = torch.sigmoid(x[n].float() @ layer.gate.weight.float().t())
        biased = scores + layer.gate.expert_bias.float()
        groups = biased.view(a.n_group, -1)
        group_scores = groups.topk(2).values.sum(-1)
        keep = set(group_scores.topk(a.topk_group).indices.tolist())
        size = a.num_experts // a.n_group
        eligible = torch.tensor([e // size in keep for e in range(a.num_experts)])
        chosen = biased.masked_fill(~eligible, float("-inf")).topk(a.num_experts_per_tok).indices
        w = scores[chosen]
        w = w / (w.sum() + 1e-20) * a.routed_scaling_factor
        for e, we in zip(chosen.tolist(), w, strict=True):
            ex = layer.experts[e]
            h = F.silu(ex.gate_proj(x[n])) * ex.up_proj(x[n])
            out[n] += we * ex.down_proj(h)
        sh = layer.shared_experts
        out[n] += sh.down_proj(F.silu(sh.gate_proj(x[n])) * sh.up_proj(x[n]))
    return out


def tiny_moe(seed: int) -> LLaDA2SparseMoe:
    ids = {"<|endoftext|>": 0}
    arch = LLaDA2Arch.from_config(llada2_config(16, ids, num_experts=16, num_experts_per_tok=3))
    torch.manual_seed(seed)
    layer = LLaDA2SparseMoe(arch)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.gate.expert_bias.normal_(0.0, 0.3)  # large enough to change choices
    return layer


def test_moe_grouped_gemm_equals_published_routing_loop(monkeypatch) -> None:
    layer = tiny_moe(0)
    x = torch.randn(37, 64)
    ref = published_moe_loop(layer, x)
    torch.testing.assert_close(layer(x[None])[0], ref, rtol=1e-5, atol=1e-5)  # unfused
    layer.fuse()
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.testing.assert_close(layer(x[None])[0], ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # gate/up and down: two grouped GEMMs, no loop over experts

    def broken(*args, **kwargs):
        raise RuntimeError("no grouped mm here")

    monkeypatch.setattr(torch, "_grouped_mm", broken)
    monkeypatch.setattr(moe_mod, "_GROUPED_MM_FAILED", set())
    monkeypatch.setattr(moe_mod, "_BMM_CHUNK_ELEMENTS", 64 * 64 * 5)  # several chunks
    torch.testing.assert_close(layer(x[None])[0], ref, rtol=1e-5, atol=1e-5)


def test_moe_equals_transformers_bailing_moe_block() -> None:
    """transformers' own BailingHybridMoE (Ling 2.x, the same router and experts) agrees."""
    from transformers.models.bailing_hybrid.configuration_bailing_hybrid import (
        BailingHybridConfig,
    )
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridMoE

    layer = tiny_moe(1)
    a = layer.a
    cfg = BailingHybridConfig(
        hidden_size=a.hidden_size,
        num_local_experts=a.num_experts,
        moe_intermediate_size=a.moe_intermediate_size,
        n_group=a.n_group,
        topk_group=a.topk_group,
        num_experts_per_tok=a.num_experts_per_tok,
        routed_scaling_factor=a.routed_scaling_factor,
        norm_topk_prob=True,
        n_shared_experts=a.num_shared_experts,
        hidden_act="silu",
    )
    hf = BailingHybridMoE(cfg).eval()
    ex = layer.experts
    state = {
        "gate.weight": layer.gate.weight,
        "gate.e_score_correction_bias": layer.gate.expert_bias,
        "experts.gate_up_proj": torch.stack(
            [torch.cat((e.gate_proj.weight, e.up_proj.weight)) for e in ex]
        ),
        "experts.down_proj": torch.stack([e.down_proj.weight for e in ex]),
    }
    state |= {f"shared_experts.{k}": v for k, v in layer.shared_experts.state_dict().items()}
    hf.load_state_dict(state, strict=True)
    layer.fuse()
    x = torch.randn(3, 11, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), hf(x), rtol=1e-5, atol=1e-5)


def test_routing_uses_bias_to_choose_and_unbiased_scores_to_weigh() -> None:
    # 8 experts in 4 groups of 2; keep 2 groups, pick 2 experts
    logit = torch.tensor([[3.0, -4.0, 1.0, 1.0, 0.5, 0.5, -1.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9])
    gate = torch.eye(8)
    kw = {"top_k": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    chosen, weights = moe_mod.route(logit, gate, torch.zeros(8), **kw)
    # group 0 (3, -4) sums below group 1 (1, 1) and 2 (.5, .5): expert 0, the best, is out
    assert sorted(chosen[0].tolist()) == [2, 3]
    chosen, weights = moe_mod.route(logit, gate, bias, **kw)
    # the bias lifts group 3 (sum of biased scores) and expert 7 within it
    assert set(chosen[0].tolist()) <= {2, 3, 6, 7} and 7 in chosen[0].tolist()
    s = torch.sigmoid(logit[0, chosen[0]])
    torch.testing.assert_close(weights[0], s / s.sum() * 2.5)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def published_llada2_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """LLaDA2MoeModelLM.forward restated (eager attention, HF rotary tables of
    head_dim * partial_rotary_factor dims, rotate_half on that part), float32, unfused weights."""
    a, m = model.arch, model.model
    b, t = ids.shape
    d, rot, eps = a.head_dim, a.rotary_dim, a.rms_norm_eps
    inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.arange(t).float()[:, None] * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()

    def rotary(x: torch.Tensor) -> torch.Tensor:
        r, rest = x[..., :rot], x[..., rot:]
        half = torch.cat((-r[..., rot // 2 :], r[..., : rot // 2]), -1)
        return torch.cat((r * cos + half * sin, rest), -1)

    h = m.word_embeddings.weight[ids]
    for layer in m.layers:
        at = layer.attention
        x = rms(h, layer.input_layernorm.weight, eps)
        qkv = (x @ at.query_key_value.weight.t()).view(b, t, -1, d)
        q, k, v = qkv.split(
            [a.num_attention_heads, a.num_key_value_heads, a.num_key_value_heads], 2
        )
        q = rotary(rms(q, at.query_layernorm.weight, eps).transpose(1, 2))
        k = rotary(rms(k, at.key_layernorm.weight, eps).transpose(1, 2))
        rep = a.num_attention_heads // a.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(rep, 1)
        scores = (q @ k.transpose(2, 3)) / d**0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
        h = h + (scores @ v).transpose(1, 2).reshape(b, t, -1) @ at.dense.weight.t()
        x = rms(h, layer.post_attention_layernorm.weight, eps)
        if isinstance(layer.mlp, LLaDA2SparseMoe):
            h = h + published_moe_loop(layer.mlp, x.reshape(b * t, -1)).view(b, t, -1)
        else:
            mlp = layer.mlp
            gate = x @ mlp.gate_proj.weight.t()
            h = h + (F.silu(gate) * (x @ mlp.up_proj.weight.t())) @ mlp.down_proj.weight.t()
    return rms(h, m.norm.weight, eps) @ model.lm_head.weight.t()


def test_llada2_logits_equal_the_published_forward(llada2_dir: Path) -> None:
    cfg = json.loads((llada2_dir / "config.json").read_text())
    with torch.device("meta"):
        unfused = build_model(LLADA2, cfg)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(llada2_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    unfused.load_state_dict(state, assign=True, strict=True)
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    mask = block_causal(12, 8, 2)
    with torch.no_grad():
        ref = published_llada2_logits(unfused, ids, mask)
    ours = load_checkpoint(llada2_dir).model
    torch.testing.assert_close(logits(ours, ids, mask), ref, rtol=1e-4, atol=1e-4)


def test_llada2_bfloat16_runs(llada2_dir: Path) -> None:
    model = load_checkpoint(llada2_dir, dtype="bfloat16").model
    ids = torch.randint(0, model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    out = logits(model, ids, block_causal(20, 8, 2))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 20, model.vocab_size)
    assert torch.isfinite(out.float()).all()


def test_presets_are_the_published_architectures(monkeypatch) -> None:
    # parameter bytes of the bf16 presets = total_size in JetAstra/SDAR's published indexes
    for name, total_size in (("sdar-4b", 8822848512), ("sdar-8b", 16381470720)):
        with torch.device("meta"):
            model = build_model(detect_family(PRESETS[name]), PRESETS[name])
        assert sum(p.numel() for p in model.parameters()) * 2 == total_size
    a = LLaDA2Arch.from_config(PRESETS["llada2-mini"])
    assert (a.num_experts, a.num_experts_per_tok, a.n_group, a.topk_group) == (256, 8, 8, 4)
    assert (a.rotary_dim, a.first_k_dense_replace, a.num_shared_experts) == (64, 1, 1)

    # random weights for both families, on shrunk copies of the presets
    small = {
        "sdar-small": {**PRESETS["sdar-4b"], "hidden_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                       "intermediate_size": 96, "vocab_size": 512, "mask_token_id": 500},
        "llada2-small": {**PRESETS["llada2-mini"], "hidden_size": 64, "num_hidden_layers": 2,
                         "head_dim": 16, "intermediate_size": 96, "num_experts": 16,
                         "moe_intermediate_size": 32, "vocab_size": 512, "mask_token_id": 500,
                         "eos_token_id": 501},
    }  # fmt: skip
    monkeypatch.setattr("dlm_engine.presets.PRESETS", {**PRESETS, **small})
    for name in small:
        lm = random_checkpoint(name)
        assert lm.family.name == name.split("-")[0] and lm.mask_id == 500
        for pname, p in lm.model.named_parameters():
            if pname.endswith("norm.weight"):
                assert bool((p == 1).all()), pname
        for b in lm.model.buffers():
            assert bool((b == 0).all())
        ids = torch.randint(0, 512, (1, 12))
        assert torch.isfinite(logits(lm.model, ids, block_causal(12, 4))).all()


def test_chat_templates_follow_the_published_shapes(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    want = {
        "sdar": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "llada2": "<role>SYSTEM</role>Be brief.\ndetailed thinking off<|role_end|>"
        "<role>HUMAN</role>Hi<|role_end|><role>ASSISTANT</role>Hello<|role_end|>"
        "<role>HUMAN</role>2+2?<|role_end|><role>ASSISTANT</role>",
    }
    for family, text in want.items():
        ids = build_char_tokenizer(tmp_path / family, family)
        tok = AutoTokenizer.from_pretrained(str(tmp_path / family))
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
        assert all(tok.convert_tokens_to_ids(s) == i for s, i in ids.items())
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "llada2"))
    no_system = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True)
    assert no_system.startswith("<role>SYSTEM</role>detailed thinking off<|role_end|>")


def test_llada2_mask_id_falls_back_to_the_published_one(tmp_path: Path) -> None:
    class Tok:  # a tokenizer that names no mask token
        eos_token_id = 156892

        def get_vocab(self) -> dict[str, int]:
            return {"<|endoftext|>": 156892}

    cfg = {"vocab_size": 157184}
    assert _special_ids(LLADA2, cfg, {}, Tok())[:2] == (156895, 156892)
    with pytest.raises(ValueError, match="mask"):
        _special_ids(LLADA2, {"vocab_size": 1000}, {}, Tok())
    assert SDAR.published_mask_id == 151669
    ids = build_char_tokenizer(tmp_path, "llada2")
    assert vocab_size_for(ids) == max(ids.values()) + 1
