"""SDAR (JetLM/SDAR-1.7B/4B/8B-Chat): a Qwen3-layout transformer run block-causally.

SDAR denoises `block_size` tokens at a time: a token attends to every key of its own block
and of the blocks before it, never after (the engine passes that as a per-query key mask).
Module names mirror the published checkpoint (`model.embed_tokens`,
`model.layers.N.self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`,
`model.norm`, `lm_head`), checked against JetAstra/SDAR `training/model/SDAR-4B-Chat/
modeling_sdar.py`. As in Qwen3, q and k are RMS-normed per head before the rotary embedding,
and `head_dim` is its own config key (SDAR-4B: hidden 2560, 32 heads, head_dim 128). Logits
are unshifted: position i predicts token i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..tokenizer_build import SDAR_TOKENIZER
from .common import (
    ForwardBatch,
    HeadRMSNorm,
    QKVHeads,
    RMSNorm,
    apply_rope,
)
from .dream import DreamMLP, QwenLayoutLM
from .family import Family
from .shard_rules import QWEN_RULES


@dataclass(frozen=True)
class SDARArch:
    """The architecture keys of an SDAR `config.json` (Qwen3 names plus `block_size`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    block_size: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> SDARArch:
        if cfg.get("rope_scaling"):
            raise ValueError(f"unsupported SDAR rope_scaling {cfg['rope_scaling']!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported SDAR hidden_act {cfg.get('hidden_act')!r}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            # configuration_sdar.SDARConfig defaults: untied, no attention bias, blocks of 4
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            block_size=int(cfg.get("block_size") or 4),
        )


class SDARAttention(QKVHeads, nn.Module):
    def __init__(self, a: SDARArch) -> None:
        super().__init__()
        self.head_dim = a.head_dim
        self.n_heads, self.n_kv_heads = a.num_attention_heads, a.num_key_value_heads
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(a.hidden_size, q_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, kv_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, kv_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(q_dim, a.hidden_size, bias=a.attention_bias)
        self.q_norm = HeadRMSNorm(self.head_dim, a.rms_norm_eps)  # per head, before RoPE
        self.k_norm = HeadRMSNorm(self.head_dim, a.rms_norm_eps)
        self.qkv: nn.Linear | None = None  # set by fuse_projections()

    def forward(self, h: torch.Tensor, rope, batch: ForwardBatch, layer: int) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv_heads(h)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin, in_fp32=False), apply_rope(k, cos, sin, in_fp32=False)
        return self.o_proj(batch.attend(layer, q, k, v).transpose(1, 2).reshape(b, t, -1))


class SDARLayer(nn.Module):
    """One decoder layer; `mlp` defaults to the Qwen MLP (same names, no biases), SDAR-MoE
    passes its routed experts."""

    def __init__(self, a: SDARArch, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = SDARAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = DreamMLP(a) if mlp is None else mlp

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch, layer: int) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, batch, layer)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        return x + self.mlp(h)


class _Backbone(nn.Module):
    def __init__(self, a: SDARArch, layers: nn.ModuleList) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class SDARModel(QwenLayoutLM):
    """`SDARForCausalLM` weights; logits are unshifted, attention block-causal (by the mask)."""

    def __init__(self, arch: SDARArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = _Backbone(arch, nn.ModuleList(self.make_layers(arch)))
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.head_dim = arch.head_dim
        self.rope_theta = arch.rope_theta

    @property
    def block_size(self) -> int:
        """The denoising block the checkpoint was trained with (config `block_size`)."""
        return self.arch.block_size

    @staticmethod
    def make_layers(arch: SDARArch) -> list[nn.Module]:
        return [SDARLayer(arch) for _ in range(arch.num_hidden_layers)]


def _is_sdar(config: dict[str, Any]) -> bool:
    archs = [str(a).lower() for a in config.get("architectures") or []]
    return str(config.get("model_type", "")).lower() == "sdar" or "sdarforcausallm" in archs


# SDAR: Qwen3 tokenizer and chat template; blocks of 4 (config `block_size`), decoded with the
# published generate.py's default remasking strategy (confidence_threshold 0.85); Diffulex's
# SDAR sampler compares multi_bd confidences with a fixed 0.95 (diffulex/sampler/sdar.py).
FAMILY = Family(
    name="sdar",
    label="SDAR",
    detect=_is_sdar,
    build=lambda config: SDARModel(SDARArch.from_config(config)),
    default_algorithm="low_confidence_dynamic",
    uses_blocks_by_default=True,
    mask_token="<|MASK|>",
    end_of_turn_tokens=("<|im_end|>", "<|endoftext|>"),
    block_diffusion=True,
    default_block_length=4,
    published_mask_id=151669,  # SDAR's config `mask_token_id`
    generation_length=128,  # SDAR generate.py: gen_length 128
    char_tokenizer=SDAR_TOKENIZER,
    default_thresholds={"low_confidence_dynamic": 0.85, "multi_bd": 0.95},
    shard_rules=QWEN_RULES,
)
