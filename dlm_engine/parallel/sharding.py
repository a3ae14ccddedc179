"""Which published tensors each rank holds a slice of, per family, and reading only that slice.

One table per family names its published tensors by pattern: `column` (output features
split: q/k/v by heads, gate/up by intermediate size), `row` (input features split: attention
output, MLP down; summed over ranks by `RowParallelLinear`), `vocab` (the untied output head,
split by vocabulary rows: `VocabParallelHead`), `qkv` (a published fused q/k/v: each rank's
heads of each part), `partial` (row-split, summed by its module's all-reduce: LLaDA2's MLPs,
routed and shared experts together, tensor parallel inside every expert). Everything else
(embeddings, norms, a head tied to the embedding, the MoE router) is replicated. Shards are
cut before `fuse_projections`, so a rank's fused q/k/v (or stacked experts) is built from its
own shards.

Expert parallel (`expert_parallel`): a family's routed experts (`FamilyRules.expert_list`) are
spread whole over the ranks instead: rank r holds experts r*E/N .. (r+1)*E/N - 1, read whole and
renumbered from 0, and its MoE layer learns its first expert (`first_expert`, see
`models/moe.py`'s `run_experts`); the shared expert and everything else stays as above, so the
MoE layer still ends in the one all-reduce that sums the ranks' partial outputs.
DiffusionGemma runs only under expert parallel: its stacked experts (`expert_stack`) are
sliced by expert into `gemma.LocalExperts`, everything else is replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..hub import weight_files
from .layers import RowParallelLinear, VocabParallelHead

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"
# a row-split layer whose partial output is summed over ranks by its module's all-reduce
# (`FamilyRules.summed`), not its own: LLaDA2's MLPs, where the routed experts and the shared
# expert add up before one all-reduce a layer
PARTIAL = "partial"
# a published fused q/k/v projection: each rank takes its heads of q, of k and of v
QKV = "qkv"
# one routed expert's tensor under expert parallel: whole on the rank that holds the expert
EXPERT = "expert"
# a stacked experts tensor [E, ...] under expert parallel: this rank's E/N experts
EXPERT_ROWS = "expert_rows"
NEVER = r"(?!)"  # a pattern no name matches (the root module's empty name included)


@dataclass(frozen=True)
class FamilyRules:
    """How one family's published tensors are split (first matching pattern wins; the rest
    is replicated), which modules' outputs are all-reduced, and the q / k-or-v rows of a
    fused q/k/v tensor."""

    tensors: tuple[tuple[str, str], ...]
    summed: tuple[str, ...] = ()
    qkv_rows: Callable[[dict[str, Any]], tuple[int, int]] | None = None
    # expert parallel: the routed experts' module list (its parent gets `first_expert`), a
    # pattern of one expert's published tensors (group 1: the expert's number) and the
    # config key of their count; None: no routed experts to spread
    expert_list: str | None = None
    expert_tensor: str | None = None
    expert_count_key: str = "num_experts"
    # expert parallel over stacked experts: the module (replaced by `gemma.LocalExperts`) and
    # a pattern of its published tensors, sliced by expert
    expert_stack: str | None = None
    expert_stack_tensor: str | None = None
    # False: nothing is split by tensor parallel (only expert parallel runs)
    tensor_parallel: bool = True
    skip: tuple[str, ...] = ()  # published tensors never read (a vision tower)


# LLaDA (`model.transformer.blocks.N.*`): the head `model.transformer.ff_out` is the vocab
# slice; `blocks.N.ff_out` is the MLP's down projection.
LLADA_RULES = FamilyRules(
    (
        (r"\.blocks\.\d+\.(q_proj|k_proj|v_proj|ff_proj|up_proj)\.(weight|bias)$", COLUMN),
        (r"\.blocks\.\d+\.(attn_out|ff_out)\.(weight|bias)$", ROW),
        (r"^model\.transformer\.ff_out\.(weight|bias)$", VOCAB),
    )
)
# The Qwen layout (Dream: Qwen2; SDAR: Qwen3, whose per-head q/k norms are replicated).
QWEN_RULES = FamilyRules(
    (
        (r"\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$", COLUMN),
        (r"\.mlp\.(gate_proj|up_proj)\.weight$", COLUMN),
        (r"\.self_attn\.o_proj\.(weight|bias)$", ROW),
        (r"\.mlp\.down_proj\.weight$", ROW),
        (r"^lm_head\.weight$", VOCAB),
    )
)


def _llada2_qkv_rows(config: dict[str, Any]) -> tuple[int, int]:
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    return heads * head_dim, kv * head_dim


# LLaDA2 (BailingMoeV2): fused `query_key_value`, `dense`; every MLP (the dense first layers,
# each routed expert, the shared expert) split by its intermediate size; the router and its
# expert bias replicated, so every rank routes every token alike.
LLADA2_RULES = FamilyRules(
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
# SDAR-MoE (Qwen3-MoE layout): attention as Qwen's; every MLP (dense layers, each routed
# expert) split by its intermediate size and summed once a layer, as LLaDA2's; router
# replicated
SDAR_MOE_RULES = FamilyRules(
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
# DiffusionGemma (`model.decoder.layers.N.experts.{gate_up_proj,down_proj}`, [E, ...]): only
# its experts are spread (expert parallel); attention, dense MLPs and router are replicated
GEMMA_RULES = FamilyRules(
    (),
    expert_stack=r"\.layers\.\d+\.experts$",
    expert_stack_tensor=r"\.layers\.\d+\.experts\.(gate_up_proj|down_proj)$",
    tensor_parallel=False,
    skip=("model.encoder.vision_tower.", "model.encoder.embed_vision."),
)
RULES: dict[str, FamilyRules] = {
    "llada": LLADA_RULES,
    "dream": QWEN_RULES,
    "sdar": QWEN_RULES,
    "fast_dllm_v2": QWEN_RULES,  # Qwen2.5's tensors, as Dream's
    "sdar_moe": SDAR_MOE_RULES,
    "llada2": LLADA2_RULES,
    "diffusion_gemma": GEMMA_RULES,
}


def _has_experts(rules: FamilyRules) -> bool:
    return rules.expert_tensor is not None or rules.expert_stack is not None


def rules_for(family: str, expert_parallel: bool = False) -> FamilyRules:
    """The family's table, or a clear error naming the setting for a family without one."""
    rules = RULES.get(family)
    if rules is None or not (rules.tensor_parallel or expert_parallel):
        split = sorted(f for f, r in RULES.items() if r.tensor_parallel)
        only_ep = sorted(f for f, r in RULES.items() if not r.tensor_parallel)
        raise ValueError(
            f"tensor_parallel_size > 1 is not supported for the {family} family yet "
            f"(supported: {', '.join(split)}; with expert_parallel only: {', '.join(only_ep)}); "
            "serve it with tensor_parallel_size 1"
        )
    return rules


def check_expert_parallel(family: str, rules: FamilyRules) -> None:
    """A clear error naming the setting for a family without routed experts."""
    if not _has_experts(rules):
        with_experts = sorted(f for f, r in RULES.items() if _has_experts(r))
        raise ValueError(
            f"expert_parallel is not supported for the {family} family (supported: "
            f"{', '.join(with_experts)}); serve it without expert_parallel"
        )


def kind_of(name: str, rules: FamilyRules, expert_parallel: bool = False) -> str:
    """How the published tensor `name` is split across ranks."""
    if expert_parallel and rules.expert_tensor and re.search(rules.expert_tensor, name):
        return EXPERT
    if expert_parallel and rules.expert_stack_tensor and re.search(rules.expert_stack_tensor, name):
        return EXPERT_ROWS
    for pattern, kind in rules.tensors:
        if re.search(pattern, name):
            return kind
    return REPLICATED


def _split(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide {what} ({n})")
    return n // world


def _sum_over_ranks(group):
    def hook(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out, group=group)
        return out

    return hook


def _keep_own_experts(model: nn.Module, name: str, experts: nn.ModuleList, rank: int, world: int):
    """Expert parallel: the list `name` keeps rank `rank`'s experts (whole), renumbered from
    0; its parent layer learns which model expert its first one is."""
    n = _split(len(experts), world, f"{name} (num_experts) under expert_parallel")
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, nn.ModuleList(list(experts)[rank * n : (rank + 1) * n]))
    parent.first_expert = rank * n


def shard_model(
    model: nn.Module,
    family: str,
    world: int,
    group=None,
    rank: int = 0,
    expert_parallel: bool = False,
) -> None:
    """Turn a model built on the meta device into one rank's shard of it: column layers
    with 1/world of their outputs, row layers with 1/world of their inputs (all-reduced),
    the untied head over 1/world of the vocabulary, attention over 1/world of the heads;
    with `expert_parallel`, 1/world of the routed experts, whole."""
    rules = rules_for(family, expert_parallel)
    if expert_parallel:
        check_expert_parallel(family, rules)
    for name, module in list(model.named_modules()):
        if expert_parallel and re.search(rules.expert_stack or NEVER, name):
            from .gemma import LocalExperts

            parent_name, _, attr = name.rpartition(".")
            setattr(
                model.get_submodule(parent_name), attr, LocalExperts(module, rank, world, group)
            )
            continue
        if not rules.tensor_parallel:
            continue  # the rest is replicated
        if expert_parallel and re.search(rules.expert_list or NEVER, name):
            _keep_own_experts(model, name, module, rank, world)
            continue
        if expert_parallel and re.search(rules.expert_tensor or NEVER, name + "."):
            continue  # inside a routed expert: whole, or gone with the others' experts
        if hasattr(module, "n_heads") and hasattr(module, "n_kv_heads"):
            module.n_heads = _split(module.n_heads, world, f"{name} attention heads")
            module.n_kv_heads = _split(module.n_kv_heads, world, f"{name} key/value heads")
        if any(re.search(p, name) for p in rules.summed):
            module.register_forward_hook(_sum_over_ranks(group))
        if type(module) is not nn.Linear:
            continue
        kind = kind_of(f"{name}.weight", rules)
        bias = module.bias is not None
        if kind in (COLUMN, QKV):
            out = _split(module.out_features, world, f"{name} outputs")
            new: nn.Linear = nn.Linear(module.in_features, out, bias=bias)
        elif kind == ROW:
            inp = _split(module.in_features, world, f"{name} inputs")
            new = RowParallelLinear(inp, module.out_features, bias, group)
        elif kind == PARTIAL:
            if bias:  # every rank would add it before the sum
                raise ValueError(f"{name}: a partial row layer with a bias is not supported")
            inp = _split(module.in_features, world, f"{name} inputs")
            new = nn.Linear(inp, module.out_features, bias=False)
        elif kind == VOCAB:
            new = VocabParallelHead(module.in_features, module.out_features, world, bias, group)
        else:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _slice(sl, kind: str, rank: int, world: int, qkv: tuple[int, int] | None) -> torch.Tensor:
    """This rank's part of the safetensors slice `sl` (only those bytes are read)."""
    shape = sl.get_shape()
    if kind == COLUMN:
        n = shape[0] // world
        return sl[rank * n : (rank + 1) * n]
    if kind == QKV and qkv is not None:  # [q; k; v] rows: this rank's heads of each
        q_rows, kv_rows = qkv
        q, kv = q_rows // world, kv_rows // world
        starts = (rank * q, q_rows + rank * kv, q_rows + kv_rows + rank * kv)
        return torch.cat([sl[a : a + n] for a, n in zip(starts, (q, kv, kv), strict=True)])
    if kind in (ROW, PARTIAL) and len(shape) == 2:  # a row layer's bias is whole
        n = shape[1] // world
        return sl[:, rank * n : (rank + 1) * n]
    if kind == EXPERT_ROWS:
        n = shape[0] // world
        return sl[rank * n : (rank + 1) * n]
    if kind == VOCAB:
        per = -(-shape[0] // world)
        lo, hi = min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
        part = sl[lo:hi]
        if hi - lo < per:  # the last slice of a vocabulary that does not divide: zero rows
            pad = torch.zeros((per - (hi - lo), *part.shape[1:]), dtype=part.dtype)
            part = torch.cat([part, pad])
        return part
    return sl[:]


def read_shard(
    path: Path,
    family: str,
    config: dict[str, Any],
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    expert_parallel: bool = False,
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every published tensor, cast to `dtype` when floating; under
    `expert_parallel` only this rank's routed experts, whole and renumbered from 0 (the
    others' bytes are never read)."""
    rules = rules_for(family, expert_parallel)
    qkv = rules.qkv_rows(config) if rules.qkv_rows is not None else None
    per_rank = 0
    if expert_parallel and rules.expert_tensor is not None:
        check_expert_parallel(family, rules)
        per_rank = _split(int(config[rules.expert_count_key]), world, "num_experts")
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if rules.skip and name.startswith(rules.skip):
                    continue
                kind = kind_of(name, rules, expert_parallel)
                if kind == EXPERT:
                    local = _own_expert(name, rules, rank, per_rank)
                    if local is None:
                        continue
                    t, name = sf.get_tensor(name), local
                else:
                    t = _slice(sf.get_slice(name), kind, rank, world, qkv)
                t = t.to(dtype) if t.is_floating_point() else t
                state[name] = t.to(device)
    return state


def _own_expert(name: str, rules: FamilyRules, rank: int, per_rank: int) -> str | None:
    """The local name of a routed expert's tensor on rank `rank` (experts renumbered from
    0), or None when another rank holds that expert."""
    m = re.search(rules.expert_tensor or NEVER, name)
    assert m is not None
    local = int(m.group(1)) - rank * per_rank
    if not 0 <= local < per_rank:
        return None
    return f"{name[: m.start(1)]}{local}{name[m.end(1) :]}"
