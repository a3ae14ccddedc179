"""Dream (Dream-org/Dream-v0-Instruct-7B): a Qwen2-layout transformer run bidirectionally.

Module names mirror the published checkpoint (`model.embed_tokens`, `model.layers.N.self_attn.*`,
`mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`). Dream's logits are shifted right by one:
the token at position i is predicted from the hidden state at i - 1 (`logits_shift = 1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..tokenizer_build import DREAM_TOKENIZER
from .common import (
    BidirectionalLM,
    ForwardBatch,
    QKVHeads,
    RMSNorm,
    apply_rope_qk,
    fuse_gate_up,
    gated_mlp,
)
from .family import D3LLMLoop, Family
from .shard_rules import QWEN_RULES


@dataclass(frozen=True)
class DreamArch:
    """The architecture keys of a Dream `config.json` (Qwen2 names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> DreamArch:
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


class DreamAttention(QKVHeads, nn.Module):
    def __init__(self, a: DreamArch) -> None:
        super().__init__()
        self.head_dim = a.hidden_size // a.num_attention_heads
        self.n_heads, self.n_kv_heads = a.num_attention_heads, a.num_key_value_heads
        kv_dim = self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(a.hidden_size, a.hidden_size, bias=True)
        self.k_proj = nn.Linear(a.hidden_size, kv_dim, bias=True)
        self.v_proj = nn.Linear(a.hidden_size, kv_dim, bias=True)
        self.o_proj = nn.Linear(a.hidden_size, a.hidden_size, bias=False)
        self.qkv: nn.Linear | None = None  # set by fuse_projections()

    def forward(self, h: torch.Tensor, rope, batch: ForwardBatch, layer: int) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv_heads(h)
        cos, sin = rope
        q, k = apply_rope_qk(q, k, cos, sin, in_fp32=False)
        return self.o_proj(batch.attend(layer, q, k, v).transpose(1, 2).reshape(b, t, -1))


class DreamMLP(nn.Module):
    def __init__(self, a: DreamArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

        self.gate_up: nn.Linear | None = None  # set by fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_mlp(self, "gate_proj", "up_proj", x))


class DreamLayer(nn.Module):
    def __init__(self, a: DreamArch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = DreamAttention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = DreamMLP(a)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch, layer: int) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, batch, layer)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        return x + self.mlp(h)


class _Backbone(nn.Module):
    def __init__(self, a: DreamArch) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DreamLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class QwenLayoutLM(BidirectionalLM):
    """What every Qwen-layout family shares (Dream: Qwen2; SDAR: Qwen3): `model.embed_tokens`,
    `model.layers` with `self_attn` / `mlp`, `model.norm`, and `lm_head` unless tied. Subclasses
    set `self.arch` and `self.model`."""

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def fuse_projections(self) -> None:
        """Fused q/k/v and gate/up layers (after loading weights)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            fuse_gate_up(layer.mlp, "gate_proj", "up_proj")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(h)
        if self.arch.tie_word_embeddings:
            return F.linear(h, self.model.embed_tokens.weight)
        return self.lm_head(h)


class DreamModel(QwenLayoutLM):
    """`DreamModel` weights; logits shifted right by one (`logits_shift = 1`)."""

    logits_shift = 1

    def __init__(self, arch: DreamArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = _Backbone(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.head_dim = arch.hidden_size // arch.num_attention_heads
        self.rope_theta = arch.rope_theta


def _is_dream(config: dict[str, Any]) -> bool:
    archs = [str(a).lower() for a in config.get("architectures") or []]
    return str(config.get("model_type", "")).lower() == "dream" or any(
        a.startswith("dream") for a in archs
    )


# Dream: Qwen2 tokenizer, logits shifted by one; Dream's own schedule and `origin` sampler;
# d3LLM's Dream loops compare entropies strictly, single-block in the logits' dtype.
FAMILY = Family(
    name="dream",
    label="Dream",
    detect=_is_dream,
    build=lambda config: DreamModel(DreamArch.from_config(config)),
    default_algorithm="entropy",
    uses_blocks_by_default=False,
    mask_token="<|mask|>",
    end_of_turn_tokens=("<|im_end|>", "<|endoftext|>"),
    generation_length=512,  # Dream's README: max_new_tokens 512
    char_tokenizer=DREAM_TOKENIZER,
    own_algorithms=frozenset({"origin"}),
    linear_schedule=False,
    d3llm_loop=D3LLMLoop(
        strict=True, single_block_f64=False, multi_block_keeps_best=False, cache_walk_stops=False
    ),
    # eval_scripts/dream_gsm8k_cot.sh, README (SGLang, tau 0.4)
    d3llm_defaults={"multi_block": True, "algorithm": "entropy_threshold", "threshold": 0.4},
    shard_rules=QWEN_RULES,
)
