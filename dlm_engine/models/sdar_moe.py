"""SDAR-MoE (JetLM/SDAR-30B-A3B-Chat, SDAR-30B-A3B-Sci): SDAR's block diffusion on a
Qwen3-MoE backbone.

Attention, norms, rotary embedding and block structure are SDAR's (models/sdar.py); the MLP of
every sparse layer is Qwen3-MoE's routed experts with no shared expert, as published
(`SDARMoeForCausalLM`, `model_type` "sdar_moe"; the same routing as transformers'
`Qwen3MoeSparseMoeBlock`): router logits `mlp.gate` [E, hidden]; softmax over all experts in
float32; the `num_experts_per_tok` most probable chosen; their probabilities renormalised to
sum to one when `norm_topk_prob`, then cast to the hidden dtype. Experts are published one by
one (`mlp.experts.E.{gate,up,down}_proj`) and run stacked as two grouped GEMMs
(`moe.run_experts`), which also spreads them over ranks under expert parallel. A layer in
`mlp_only_layers`, or off the `decoder_sparse_step` stride, keeps a dense Qwen MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..tokenizer_build import SDAR_TOKENIZER
from .common import fuse_gate_up
from .family import Family
from .moe import run_experts, stack_experts
from .sdar import FAMILY as SDAR_FAMILY
from .sdar import SDARArch, SDARLayer, SDARModel
from .shard_rules import COLUMN, PARTIAL, QWEN_RULES, ROW, VOCAB, ShardRules


@dataclass(frozen=True)
class SDARMoeArch(SDARArch):
    """SDAR's keys plus Qwen3-MoE's (`configuration_qwen3_moe.Qwen3MoeConfig` names)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> SDARMoeArch:
        if not cfg.get("num_experts"):
            raise ValueError("SDAR-MoE config without num_experts (a dense model is SDAR)")
        base = SDARArch.from_config(cfg)
        return cls(
            **base.__dict__,
            num_experts=int(cfg["num_experts"]),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 8),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            # Qwen3MoeConfig's defaults: weights not renormalised, every layer sparse
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        """Qwen3-MoE's rule: routed experts unless listed dense or off the sparse stride."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class SDARMoeExpert(nn.Module):
    """One routed expert's published projections (read, then stacked by `fuse`)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class SDARMoeRouter(nn.Module):
    """The router `mlp.gate.weight` [E, hidden]. Not an `nn.Linear`, so weight quantization
    (FP8, bitsandbytes) leaves it in the checkpoint's dtype, as published FP8 Qwen3-MoE
    checkpoints keep their gates, and routing stays that of the bf16 model."""

    def __init__(self, a: SDARMoeArch) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(a.num_experts, a.hidden_size))


class SDARMoeSparseMoe(nn.Module):
    """Routed experts without a shared expert. After `fuse()` they live only as stacked
    `w_gate_up` [E, hidden, 2 * moe_intermediate] and `w_down` [E, moe_intermediate, hidden]."""

    def __init__(self, a: SDARMoeArch) -> None:
        super().__init__()
        self.a = a
        self.gate = SDARMoeRouter(a)
        self.experts = nn.ModuleList(
            SDARMoeExpert(a.hidden_size, a.moe_intermediate_size) for _ in range(a.num_experts)
        )
        self.w_gate_up: nn.Parameter | None = None  # set by fuse()
        self.w_down: nn.Parameter | None = None
        # expert parallel: `experts` holds this rank's slice, from this model expert on
        # (dlm_engine/parallel/sharding.py); None: every expert
        self.first_expert: int | None = None

    def fuse(self) -> None:
        with torch.no_grad():
            gate_up, down = stack_experts(self.experts)
        self.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.w_down = nn.Parameter(down, requires_grad=False)
        del self.experts

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts [N, k] and their weights [N, k] (hidden dtype, as published)."""
        probs = torch.softmax(F.linear(flat, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.a.num_experts_per_tok, dim=-1)
        if self.a.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(flat.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.route(flat)
        if self.w_gate_up is not None:
            gate_up, down = self.w_gate_up, self.w_down
        else:
            gate_up, down = stack_experts(self.experts)
        return run_experts(flat, chosen, weights, gate_up, down, self.first_expert).view_as(x)


class SDARMoeModel(SDARModel):
    """`SDARMoeForCausalLM` weights: SDAR's model with routed experts in the sparse layers;
    logits unshifted, attention block-causal (by the mask)."""

    arch: SDARMoeArch

    @staticmethod
    def make_layers(arch: SDARMoeArch) -> list[nn.Module]:
        return [
            SDARLayer(arch, SDARMoeSparseMoe(arch) if arch.is_sparse(i) else None)
            for i in range(arch.num_hidden_layers)
        ]

    def fuse_projections(self) -> None:
        """Fused q/k/v, stacked experts in sparse layers, fused gate/up in dense ones."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            if isinstance(layer.mlp, SDARMoeSparseMoe):
                layer.mlp.fuse()
            else:
                fuse_gate_up(layer.mlp, "gate_proj", "up_proj")


def _is_sdar_moe(config: dict[str, Any]) -> bool:
    archs = [str(a).lower() for a in config.get("architectures") or []]
    return str(config.get("model_type", "")).lower() == "sdar_moe" or "sdarmoeforcausallm" in archs


# SDAR-MoE (Qwen3-MoE layout): attention as Qwen's; every MLP (dense layers, each routed
# expert) split by its intermediate size and summed once a layer, as LLaDA2's; router
# replicated
SDAR_MOE_RULES = ShardRules(
    (
        *QWEN_RULES.tensors[:1],
        (r"\.mlp\.(experts\.\d+\.)?(gate_proj|up_proj)\.weight$", COLUMN),
        (r"\.self_attn\.o_proj\.(weight|bias)$", ROW),
        (r"\.mlp\.(experts\.\d+\.)?down_proj\.weight$", PARTIAL),
        (r"^lm_head\.weight$", VOCAB),
    ),
    summed=(r"\.layers\.\d+\.mlp$",),
    expert_list=r"\.mlp\.experts$",
    expert_tensor=r"\.mlp\.experts\.(\d+)\.",
)


# SDAR-MoE decodes as SDAR does (same tokenizer, template, mask id, blocks of 4 and rules;
# SGLang's DLLM_PARAMS give both architectures block_size 4, mask_id 151669)
FAMILY = Family(
    name="sdar_moe",
    label="SDAR-MoE",
    table_label="SDAR (MoE)",
    detect=_is_sdar_moe,
    build=lambda config: SDARMoeModel(SDARMoeArch.from_config(config)),
    default_algorithm=SDAR_FAMILY.default_algorithm,
    uses_blocks_by_default=True,
    mask_token=SDAR_FAMILY.mask_token,
    end_of_turn_tokens=SDAR_FAMILY.end_of_turn_tokens,
    block_diffusion=True,
    default_block_length=SDAR_FAMILY.default_block_length,
    published_mask_id=SDAR_FAMILY.published_mask_id,
    generation_length=SDAR_FAMILY.generation_length,
    char_tokenizer=SDAR_TOKENIZER,
    default_thresholds=SDAR_FAMILY.default_thresholds,
    shard_rules=SDAR_MOE_RULES,
)
