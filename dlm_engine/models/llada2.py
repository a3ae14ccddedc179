"""LLaDA2 (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini): a block-diffusion mixture-of-experts
transformer in the BailingMoeV2 (Ling 2.0) layout.

Module names mirror the published checkpoint (`model.word_embeddings`,
`model.layers.N.attention.{query_key_value,query_layernorm,key_layernorm,dense}`,
`mlp.{gate,up,down}_proj` for the first `first_k_dense_replace` layers, then
`mlp.gate.{weight,expert_bias}`, `mlp.experts.E.{gate,up,down}_proj`,
`mlp.shared_experts.{gate,up,down}_proj`, `model.norm`, `lm_head`), as inclusionAI's
`modeling_llada2_moe.py` defines them. Attention: one fused q/k/v projection (q heads, then k,
then v), RMS norm per head on q and k, then rotary embedding on the first
`head_dim * partial_rotary_factor` dims of each head (rotate-half style, tables cast to the
model dtype), the rest passed through. Logits are unshifted; attention is block-causal (blocks
of 32 by default), given by the engine's per-query key mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..tokenizer_build import LLADA2_TOKENIZER
from .common import (
    BidirectionalLM,
    ForwardBatch,
    HeadRMSNorm,
    RMSNorm,
    apply_rope,
    fuse_gate_up,
    gated_mlp,
    rope_tables,
)
from .family import Family
from .moe import route, run_experts, stack_experts
from .shard_rules import COLUMN, PARTIAL, QKV, ROW, VOCAB, ShardRules


@dataclass(frozen=True)
class LLaDA2Arch:
    """The architecture keys of a LLaDA2 `config.json` (`LLaDA2MoeConfig` names)."""

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
    use_qkv_bias: bool
    use_bias: bool
    partial_rotary_factor: float
    first_k_dense_replace: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> LLaDA2Arch:
        if cfg.get("rope_scaling"):
            raise ValueError(f"unsupported LLaDA2 rope_scaling {cfg['rope_scaling']!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported LLaDA2 hidden_act {cfg.get('hidden_act')!r}")
        if cfg.get("score_function", "sigmoid") != "sigmoid":
            raise ValueError(f"unsupported LLaDA2 score_function {cfg.get('score_function')!r}")
        if not cfg.get("num_experts"):
            raise ValueError("LLaDA2 config without num_experts (a dense model is not LLaDA2)")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        # defaults are LLaDA2MoeConfig's where the published config.json may omit a key
        return cls(
            hidden_size=hidden,
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            use_qkv_bias=bool(cfg.get("use_qkv_bias", False)),
            use_bias=bool(cfg.get("use_bias", True)),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 0.5)),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 0)),
            num_experts=int(cfg["num_experts"]),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            num_shared_experts=int(cfg.get("num_shared_experts") or 0),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            n_group=int(cfg.get("n_group", 8)),
            topk_group=int(cfg.get("topk_group", 4)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head, pass the rest through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin, in_fp32=False)
    return torch.cat((apply_rope(x[..., :rot], cos, sin, in_fp32=False), x[..., rot:]), dim=-1)


class LLaDA2Attention(nn.Module):
    def __init__(self, a: LLaDA2Arch) -> None:
        super().__init__()
        self.head_dim = a.head_dim
        self.n_heads, self.n_kv_heads = a.num_attention_heads, a.num_key_value_heads
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(a.hidden_size, qkv_out, bias=a.use_qkv_bias)
        self.query_layernorm = HeadRMSNorm(self.head_dim, a.rms_norm_eps)
        self.key_layernorm = HeadRMSNorm(self.head_dim, a.rms_norm_eps)
        self.dense = nn.Linear(self.n_heads * self.head_dim, a.hidden_size, bias=a.use_bias)

    def forward(self, h: torch.Tensor, rope, batch: ForwardBatch, layer: int) -> torch.Tensor:
        b, t, _ = h.shape
        qkv = self.query_key_value(h).view(b, t, -1, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        q = self.query_layernorm(q).transpose(1, 2)
        k = self.key_layernorm(k).transpose(1, 2)
        cos, sin = rope
        q, k = _partial_rope(q, cos, sin), _partial_rope(k, cos, sin)
        att = batch.attend(layer, q, k, v.transpose(1, 2))
        return self.dense(att.transpose(1, 2).reshape(b, t, -1))


class LLaDA2MLP(nn.Module):
    """SwiGLU MLP: the dense layers, each expert, and the shared experts."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: nn.Linear | None = None  # set by fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_mlp(self, "gate_proj", "up_proj", x))

    def fuse(self) -> None:
        fuse_gate_up(self, "gate_proj", "up_proj")


class LLaDA2Gate(nn.Module):
    """The router: `weight` [E, hidden] and the load-balancing `expert_bias` [E] (a buffer)."""

    def __init__(self, a: LLaDA2Arch) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(a.num_experts, a.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(a.num_experts))


class LLaDA2SparseMoe(nn.Module):
    """Routed experts plus the shared expert. After `fuse()` the experts live only as stacked
    weights `w_gate_up` [E, hidden, 2 * moe_intermediate] and `w_down` [E, moe_intermediate,
    hidden] for the grouped GEMMs; the per-expert modules exist only to load the checkpoint."""

    def __init__(self, a: LLaDA2Arch) -> None:
        super().__init__()
        self.a = a
        self.gate = LLaDA2Gate(a)
        self.experts = nn.ModuleList(
            LLaDA2MLP(a.hidden_size, a.moe_intermediate_size) for _ in range(a.num_experts)
        )
        if a.num_shared_experts > 0:
            shared = a.moe_intermediate_size * a.num_shared_experts
            self.shared_experts = LLaDA2MLP(a.hidden_size, shared)
        self.w_gate_up: nn.Parameter | None = None  # set by fuse()
        self.w_down: nn.Parameter | None = None
        # expert parallel: `experts` holds this rank's slice, from this model expert on
        # (dlm_engine/parallel/sharding.py); None: every expert
        self.first_expert: int | None = None

    def fuse(self) -> None:
        if hasattr(self.experts[0].gate_proj, "weight_scale"):  # a published FP8 checkpoint
            self._fuse_fp8()
        else:
            with torch.no_grad():
                gate_up, down = stack_experts(self.experts)
            self.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
            self.w_down = nn.Parameter(down, requires_grad=False)
        del self.experts
        if self.a.num_shared_experts > 0:
            self.shared_experts.fuse()

    def _fuse_fp8(self) -> None:
        """Stack the experts' e4m3 weights and per-channel scales as stored (no
        re-quantization) for the FP8 grouped GEMMs."""
        from ..fp8 import Fp8Experts

        def stacked(names: tuple[str, ...]) -> Fp8Experts:
            layers = [[getattr(e, n) for n in names] for e in self.experts]
            if any(layer.block is not None for row in layers for layer in row):
                raise ValueError("block-scaled FP8 experts are not supported; per-channel are")
            weight = torch.stack([torch.cat([layer.weight for layer in row]) for row in layers])
            scale = torch.stack(
                [torch.cat([layer.weight_scale for layer in row]) for row in layers]
            )
            return Fp8Experts(weight, scale)

        self.w_gate_up = stacked(("gate_proj", "up_proj"))
        self.w_down = stacked(("down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = route(
            flat,
            self.gate.weight,
            self.gate.expert_bias,
            top_k=a.num_experts_per_tok,
            n_group=a.n_group,
            topk_group=a.topk_group,
            routed_scaling_factor=a.routed_scaling_factor,
            normalize=a.norm_topk_prob,
        )
        if self.w_gate_up is not None:
            gate_up, down = self.w_gate_up, self.w_down
        else:
            gate_up, down = stack_experts(self.experts)
        y = run_experts(flat, chosen, weights, gate_up, down, self.first_expert).view_as(x)
        if a.num_shared_experts > 0:
            y = y + self.shared_experts(x)
        return y


class LLaDA2Layer(nn.Module):
    def __init__(self, a: LLaDA2Arch, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.attention = LLaDA2Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp: nn.Module = (
            LLaDA2SparseMoe(a)
            if index >= a.first_k_dense_replace
            else LLaDA2MLP(a.hidden_size, a.intermediate_size)
        )

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch, layer: int) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(x), rope, batch, layer)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        return x + self.mlp(h)


class _Backbone(nn.Module):
    def __init__(self, a: LLaDA2Arch) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(LLaDA2Layer(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LLaDA2Model(BidirectionalLM):
    """`LLaDA2MoeModelLM` weights; logits unshifted, attention block-causal (by the mask)."""

    def __init__(self, arch: LLaDA2Arch) -> None:
        super().__init__()
        self.arch = arch
        self.model = _Backbone(arch)
        if not arch.tie_word_embeddings:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.head_dim = arch.head_dim
        self.rotary_dim = arch.rotary_dim
        self.rope_theta = arch.rope_theta

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def fuse_projections(self) -> None:
        """Stacked expert weights and fused gate/up layers (after loading weights); the
        fused q/k/v projection is already one layer in the published layout."""
        for layer in self.model.layers:
            layer.mlp.fuse()

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        # rotary tables span only the rotated part of each head (partial_rotary_factor)
        x = self.embed(batch.input_ids)
        rope = rope_tables(batch.positions, self.rotary_dim, self.rope_theta)
        for i, block in enumerate(self.blocks()):
            x = block(x, rope, batch, i)
        return x

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.word_embeddings(ids)

    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(h)
        if self.arch.tie_word_embeddings:
            return F.linear(h, self.model.word_embeddings.weight)
        return self.lm_head(h)


def _is_llada2(config: dict[str, Any]) -> bool:
    archs = [str(a).lower() for a in config.get("architectures") or []]
    return str(config.get("model_type", "")).lower() == "llada2_moe" or "llada2moemodellm" in archs


def _llada2_qkv_rows(config: dict[str, Any]) -> tuple[int, int]:
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    return heads * head_dim, kv * head_dim


# LLaDA2 (BailingMoeV2): fused `query_key_value`, `dense`; every MLP (the dense first layers,
# each routed expert, the shared expert) split by its intermediate size; the router and its
# expert bias replicated, so every rank routes every token alike.
LLADA2_RULES = ShardRules(
    (
        (r"\.attention\.query_key_value\.(weight|bias)$", QKV),
        (r"\.attention\.dense\.(weight|bias)$", ROW),
        (r"\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj)\.weight$", COLUMN),
        (r"\.mlp\.(experts\.\d+\.|shared_experts\.)?down_proj\.weight$", PARTIAL),
        (r"^lm_head\.weight$", VOCAB),
    ),
    summed=(r"\.layers\.\d+\.mlp$",),
    qkv_rows=_llada2_qkv_rows,
    expert_list=r"\.mlp\.experts$",
    expert_tensor=r"\.mlp\.experts\.(\d+)\.",
)


# LLaDA2: Ling 2.0 tokenizer, `<role>HUMAN</role>...<|role_end|>` turns; blocks of 32 with
# confidence-threshold decoding (0.95), as the published `generate()` does, which also caps
# steps at gen_length // minimal_topk; Diffulex's LLaDA2 sampler takes accept_threshold 0.9.
FAMILY = Family(
    name="llada2",
    label="LLaDA2",
    table_label="LLaDA2 (MoE)",
    detect=_is_llada2,
    build=lambda config: LLaDA2Model(LLaDA2Arch.from_config(config)),
    default_algorithm="threshold",
    uses_blocks_by_default=True,
    mask_token="<|mask|>",
    end_of_turn_tokens=("<|role_end|>", "<|endoftext|>"),
    block_diffusion=True,
    default_block_length=32,
    published_mask_id=156895,  # LLaDA2's `generate(mask_id=156895)`
    generation_length=512,  # LLaDA2.0's model card: gen_length 512
    char_tokenizer=LLADA2_TOKENIZER,
    default_thresholds={"low_confidence_dynamic": 0.95, "multi_bd": 0.9},
    steps_capped_by_length=True,
    shard_rules=LLADA2_RULES,
)
