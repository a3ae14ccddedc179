"""Which published tensors each rank holds a slice of, per family, and reading only that slice.

One table per family (`ShardRules`, in its model file, named by its `Family` value's
`shard_rules`; the type in `models/shard_rules.py`) names its published tensors by pattern: `column` (output features
split: q/k/v by heads, gate/up by intermediate size), `row` (input features split: attention
output, MLP down; summed over ranks by `RowParallelLinear`), `vocab` (the untied output head,
split by vocabulary rows: `VocabParallelHead`), `qkv` (a published fused q/k/v: each rank's
heads of each part), `partial` (row-split, summed by its module's all-reduce: LLaDA2's MLPs,
routed and shared experts together, tensor parallel inside every expert). Everything else
(embeddings, norms, a head tied to the embedding, the MoE router) is replicated. Shards are
cut before `fuse_projections`, so a rank's fused q/k/v (or stacked experts) is built from its
own shards.

Expert parallel (`expert_parallel`): a family's routed experts (`ShardRules.expert_list`) are
spread whole over the ranks instead: rank r holds experts r*E/N .. (r+1)*E/N - 1, read whole and
renumbered from 0, and its MoE layer learns its first expert (`first_expert`, see
`models/moe.py`'s `run_experts`); the shared expert and everything else stays as above, so the
MoE layer still ends in the one all-reduce that sums the ranks' partial outputs.
A published FP8 checkpoint's scales are split with their weights (`fp8_shards.py`).

Stacked experts (DiffusionGemma's `expert_stack`, [E, 2I, H] and [E, H, I]): under tensor
parallel every expert keeps 1/N of its intermediate size (`expert_column`: this rank's rows of
the gate half and of the up half; `expert_row`: its columns of down), the module's output
summed over ranks (`summed`); under expert parallel they are sliced by expert into
`gemma.LocalExperts` and, where the table says `split_with_experts=False`, everything else is
replicated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from ..fp8_checkpoint import fp8_format
from ..hub import weight_files
from ..loader import _takes_model_dtype
from ..models import FAMILIES, family_of
from ..models.shard_rules import (
    COLUMN,
    EXPERT,
    EXPERT_COLUMN,
    EXPERT_ROW,
    EXPERT_ROWS,
    NEVER,
    PARTIAL,
    QKV,
    REPLICATED,
    ROW,
    VOCAB,
    ShardRules,
)
from .fp8_shards import read_scale, scale_parts, weight_of
from .layers import RowParallelLinear, VocabParallelHead


def _has_experts(rules: ShardRules) -> bool:
    return rules.expert_tensor is not None or rules.expert_stack is not None


def rules_for(family: str, expert_parallel: bool = False) -> ShardRules:
    """The family's table, or a clear error naming the setting for a family without one."""
    rules = family_of(family).shard_rules
    if rules is None:
        split = sorted(f.name for f in FAMILIES if f.shard_rules is not None)
        raise ValueError(
            f"tensor_parallel_size > 1 is not supported for the {family} family yet "
            f"(supported: {', '.join(split)}); serve it with tensor_parallel_size 1"
        )
    return rules


def check_expert_parallel(family: str, rules: ShardRules) -> None:
    """A clear error naming the setting for a family without routed experts."""
    if not _has_experts(rules):
        with_experts = sorted(
            f.name for f in FAMILIES if f.shard_rules is not None and _has_experts(f.shard_rules)
        )
        raise ValueError(
            f"expert_parallel is not supported for the {family} family (supported: "
            f"{', '.join(with_experts)}); serve it without expert_parallel"
        )


def kind_of(name: str, rules: ShardRules, expert_parallel: bool = False) -> str:
    """How the published tensor `name` is split across ranks."""
    if expert_parallel and rules.expert_tensor and re.search(rules.expert_tensor, name):
        return EXPERT
    if expert_parallel and rules.expert_stack_tensor and re.search(rules.expert_stack_tensor, name):
        return EXPERT_ROWS
    if expert_parallel and not rules.split_with_experts:
        return REPLICATED
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
        if expert_parallel and not rules.split_with_experts:
            continue  # the rest is replicated
        if expert_parallel and re.search(rules.expert_list or NEVER, name):
            _keep_own_experts(model, name, module, rank, world)
            continue
        if expert_parallel and re.search(rules.expert_tensor or NEVER, name + "."):
            continue  # inside a routed expert: whole, or gone with the others' experts
        if re.search(rules.expert_stack or NEVER, name):  # tensor parallel inside each expert
            _split_expert_stack(module, name, world)
        if hasattr(module, "n_heads") and hasattr(module, "n_kv_heads"):
            module.n_heads = _split(module.n_heads, world, f"{name} attention heads")
            module.n_kv_heads = _split(module.n_kv_heads, world, f"{name} key/value heads")
        if any(re.search(p, name) for p in rules.summed):
            module.register_forward_hook(_sum_over_ranks(group))
        if type(module) is not nn.Linear:
            continue
        kind = kind_of(f"{name}.weight", rules)
        bias = module.bias is not None
        # the shard's layers live where the model was built (the meta device while loading):
        # made anywhere else they would be drawn at random on the host, a rank of a 100B model
        # holding tens of GB of float32 it then discards
        with torch.device(module.weight.device):
            new = _sharded_layer(module, kind, name, world, bias, group)
        if new is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _split_expert_stack(experts: nn.Module, name: str, world: int) -> None:
    """Stacked experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) keep 1/world of
    every expert's intermediate size, made where the model was built (meta while loading)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    e, two_i, h = gate_up.shape
    i = _split(two_i // 2, world, f"{name} (moe_intermediate_size)")
    experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, device=gate_up.device))
    experts.down_proj = nn.Parameter(torch.empty(e, down.shape[1], i, device=down.device))


def _sharded_layer(
    module: nn.Linear, kind: str, name: str, world: int, bias: bool, group
) -> nn.Linear | None:
    """`module`'s replacement on one rank (None: it stays whole)."""
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
        return None
    return new


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
    if kind == EXPERT_COLUMN:  # [E, 2I, H]: this rank's rows of the gate half and of the up half
        half = shape[1] // 2
        n = half // world
        gate, up = sl[:, rank * n : (rank + 1) * n], sl[:, half + rank * n : half + (rank + 1) * n]
        return torch.cat([gate, up], dim=1)
    if kind == EXPERT_ROW:  # [E, H, I]: this rank's columns of the intermediate size
        n = shape[2] // world
        return sl[:, :, rank * n : (rank + 1) * n]
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
    fp8 = fp8_format(config)
    shapes = _shapes(path) if fp8 is not None else {}
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if rules.skip and name.startswith(rules.skip):
                    continue
                weight = weight_of(name) if fp8 is not None else None
                kind = kind_of(weight or name, rules, expert_parallel)
                if kind == EXPERT:
                    local = _own_expert(name, rules, rank, per_rank)
                    if local is None:
                        continue
                    t, name = sf.get_tensor(name), local
                elif weight is not None and fp8 is not None:  # its weight's slice's scales
                    shape = shapes[name]
                    parts = scale_parts(
                        name, shape, shapes.get(weight, shape), kind, rank, world, fp8.block, qkv
                    )
                    t = read_scale(sf.get_slice(name), parts)
                else:
                    t = _slice(sf.get_slice(name), kind, rank, world, qkv)
                # FP8 weights and their scales stay as stored (`fp8_checkpoint.py`)
                t = t.to(dtype) if _takes_model_dtype(name, t) else t
                state[name] = t.to(device)
    return state


def _shapes(path: Path) -> dict[str, list[int]]:
    """Every published tensor's shape (the files' headers only)."""
    shapes: dict[str, list[int]] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = list(sf.get_slice(name).get_shape())
    return shapes


def check_fp8_split(path: Path, family: str, config: dict[str, Any], world: int, ep: bool) -> None:
    """Refuse, before any rank starts, an FP8 checkpoint whose scales this split would cut
    or whose output head is FP8 (reads only the files' headers)."""
    fmt = fp8_format(config)
    if fmt is None:
        return
    rules = rules_for(family, ep)
    qkv = rules.qkv_rows(config) if rules.qkv_rows is not None else None
    shapes = _shapes(path)
    for name, shape in shapes.items():
        weight = weight_of(name)
        if weight is not None:
            kind = kind_of(weight, rules, ep)
            scale_parts(name, shape, shapes.get(weight, shape), kind, 0, world, fmt.block, qkv)


def _own_expert(name: str, rules: ShardRules, rank: int, per_rank: int) -> str | None:
    """The local name of a routed expert's tensor on rank `rank` (experts renumbered from
    0), or None when another rank holds that expert."""
    m = re.search(rules.expert_tensor or NEVER, name)
    assert m is not None
    local = int(m.group(1)) - rank * per_rank
    if not 0 <= local < per_rank:
        return None
    return f"{name[: m.start(1)]}{local}{name[m.end(1) :]}"
