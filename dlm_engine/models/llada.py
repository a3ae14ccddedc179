"""LLaDA (GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5): a bidirectional Llama-style transformer.

Module names mirror the published checkpoint (`model.transformer.wte`, `blocks.N.q_proj`,
`attn_out`, `ff_proj`/`up_proj`/`ff_out`, `ln_f`, `ff_out`) so `load_state_dict` takes the
published safetensors as they are. Logits are unshifted: position i predicts token i.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..tokenizer_build import LLADA_TOKENIZER
from .common import (
    BidirectionalLM,
    ForwardBatch,
    QKVHeads,
    RMSNorm,
    apply_rope_qk,
    fuse_gate_up,
    gated_mlp,
)
from .family import Family
from .shard_rules import COLUMN, ROW, VOCAB, ShardRules


@dataclass(frozen=True)
class LLaDAArch:
    """The architecture keys of a LLaDA `config.json` (published names)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int
    rope_theta: float
    rms_norm_eps: float
    include_bias: bool
    include_qkv_bias: bool
    weight_tying: bool

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> LLaDAArch:
        if cfg.get("block_type", "llama") != "llama":
            raise ValueError(f"unsupported LLaDA block_type {cfg.get('block_type')!r}")
        n_heads = int(cfg["n_heads"])
        return cls(
            d_model=int(cfg["d_model"]),
            n_layers=int(cfg["n_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("n_kv_heads") or n_heads),
            mlp_hidden_size=int(cfg["mlp_hidden_size"]),
            vocab_size=int(cfg["vocab_size"]),
            embedding_size=int(cfg.get("embedding_size") or cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            include_bias=bool(cfg.get("include_bias", False)),
            include_qkv_bias=bool(cfg.get("include_qkv_bias", False)),
            weight_tying=bool(cfg.get("weight_tying", False)),
        )


class LLaDABlock(QKVHeads, nn.Module):
    """One pre-norm block: attention then SwiGLU MLP (`act(ff_proj(x)) * up_proj(x)`)."""

    def __init__(self, a: LLaDAArch) -> None:
        super().__init__()
        self.head_dim = a.d_model // a.n_heads
        self.n_heads, self.n_kv_heads = a.n_heads, a.n_kv_heads
        qkv_bias = a.include_bias or a.include_qkv_bias
        kv_dim = a.n_kv_heads * self.head_dim
        self.attn_norm = RMSNorm(a.d_model, a.rms_norm_eps)
        self.q_proj = nn.Linear(a.d_model, a.d_model, bias=qkv_bias)
        self.k_proj = nn.Linear(a.d_model, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(a.d_model, kv_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(a.d_model, a.d_model, bias=a.include_bias)
        self.ff_norm = RMSNorm(a.d_model, a.rms_norm_eps)
        self.ff_proj = nn.Linear(a.d_model, a.mlp_hidden_size, bias=a.include_bias)
        self.up_proj = nn.Linear(a.d_model, a.mlp_hidden_size, bias=a.include_bias)
        self.ff_out = nn.Linear(a.mlp_hidden_size, a.d_model, bias=a.include_bias)
        self.qkv: nn.Linear | None = None  # set by fuse_projections()
        self.gate_up: nn.Linear | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        layer: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv_heads(self.attn_norm(x))
        cos, sin = rope
        q, k = apply_rope_qk(q, k, cos, sin, in_fp32=True)
        att = batch.attend(layer, q, k, v).transpose(1, 2).reshape(b, t, -1)
        x, h = self.ff_norm.add_and_norm(x, self.attn_out(att))
        return x + self.ff_out(gated_mlp(self, "ff_proj", "up_proj", h))

    def fuse_projections(self) -> None:
        """Replace q/k/v and ff/up projections by fused layers (after loading weights)."""
        self.fuse_qkv()
        fuse_gate_up(self, "ff_proj", "up_proj")


class _Transformer(nn.Module):
    def __init__(self, a: LLaDAArch) -> None:
        super().__init__()
        self.wte = nn.Embedding(a.embedding_size, a.d_model)
        self.blocks = nn.ModuleList(LLaDABlock(a) for _ in range(a.n_layers))
        self.ln_f = RMSNorm(a.d_model, a.rms_norm_eps)
        if not a.weight_tying:
            self.ff_out = nn.Linear(a.d_model, a.embedding_size, bias=a.include_bias)


class _Wrapper(nn.Module):
    def __init__(self, a: LLaDAArch) -> None:
        super().__init__()
        self.transformer = _Transformer(a)


class LLaDAModel(BidirectionalLM):
    """`LLaDAModelLM` weights; logits are unshifted."""

    def __init__(self, arch: LLaDAArch) -> None:
        super().__init__()
        self.arch = arch
        self.model = _Wrapper(arch)
        self.head_dim = arch.d_model // arch.n_heads
        self.rope_theta = arch.rope_theta

    @property
    def vocab_size(self) -> int:
        return self.arch.embedding_size

    def fuse_projections(self) -> None:
        for block in self.model.transformer.blocks:
            block.fuse_projections()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.wte(ids)

    def blocks(self) -> nn.ModuleList:
        return self.model.transformer.blocks

    def head(self, h: torch.Tensor) -> torch.Tensor:
        tr = self.model.transformer
        h = tr.ln_f(h)
        if self.arch.weight_tying:
            return F.linear(h, tr.wte.weight)
        return tr.ff_out(h)


def _is_llada(config: dict[str, Any]) -> bool:
    archs = [str(a).lower() for a in config.get("architectures") or []]
    return str(config.get("model_type", "")).lower() == "llada" or any(
        a.startswith("llada") for a in archs
    )


# LLaDA (`model.transformer.blocks.N.*`): the head `model.transformer.ff_out` is the vocab
# slice; `blocks.N.ff_out` is the MLP's down projection.
LLADA_RULES = ShardRules(
    (
        (r"\.blocks\.\d+\.(q_proj|k_proj|v_proj|ff_proj|up_proj)\.(weight|bias)$", COLUMN),
        (r"\.blocks\.\d+\.(attn_out|ff_out)\.(weight|bias)$", ROW),
        (r"^model\.transformer\.ff_out\.(weight|bias)$", VOCAB),
    )
)


# LLaDA: Llama-3 style tokenizer, no logits shift; its published rules are the step schedule's
# low_confidence / random, plus Fast-dLLM's factor and dlmserve's LocalLeap (LLaDA only).
FAMILY = Family(
    name="llada",
    label="LLaDA",
    detect=_is_llada,
    build=lambda config: LLaDAModel(LLaDAArch.from_config(config)),
    default_algorithm="low_confidence",
    uses_blocks_by_default=True,
    mask_token="<|mdm_mask|>",
    end_of_turn_tokens=("<|eot_id|>", "<|endoftext|>"),
    generation_length=128,  # LLaDA chat.py: gen_length 128
    char_tokenizer=LLADA_TOKENIZER,
    own_algorithms=frozenset({"local_leap", "factor"}),
    supports_cfg=True,
    gumbel_proposals=True,
    # chat/chat_d3llm_llada.py, eval_scripts/llada_gsm8k_cot.sh, README (SGLang, tau 0.5)
    d3llm_defaults={"multi_block": True, "algorithm": "entropy_threshold", "threshold": 0.5},
    shard_rules=LLADA_RULES,
)
