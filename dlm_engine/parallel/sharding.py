"""Which published tensors each rank holds a slice of, per family, and reading only that slice.

One table per family names its published tensors by pattern: `column` (output features
split: q/k/v by heads, gate/up by intermediate size), `row` (input features split: attention
output, MLP down; summed over ranks by `RowParallelLinear`), `vocab` (the untied output head,
split by vocabulary rows: `VocabParallelHead`). Everything else (embeddings, norms, a head
tied to the embedding) is replicated. Shards are cut before `fuse_projections`, so a rank's
fused q/k/v is the concatenation of its own q, k and v shards.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..hub import weight_files
from .layers import RowParallelLinear, VocabParallelHead

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"

# LLaDA (`model.transformer.blocks.N.*`): the head `model.transformer.ff_out` is the vocab
# slice; `blocks.N.ff_out` is the MLP's down projection.
LLADA_RULES: tuple[tuple[str, str], ...] = (
    (r"\.blocks\.\d+\.(q_proj|k_proj|v_proj|ff_proj|up_proj)\.(weight|bias)$", COLUMN),
    (r"\.blocks\.\d+\.(attn_out|ff_out)\.(weight|bias)$", ROW),
    (r"^model\.transformer\.ff_out\.(weight|bias)$", VOCAB),
)
# The Qwen layout (Dream: Qwen2; SDAR: Qwen3, whose per-head q/k norms are replicated).
QWEN_RULES: tuple[tuple[str, str], ...] = (
    (r"\.self_attn\.(q_proj|k_proj|v_proj)\.(weight|bias)$", COLUMN),
    (r"\.mlp\.(gate_proj|up_proj)\.weight$", COLUMN),
    (r"\.self_attn\.o_proj\.(weight|bias)$", ROW),
    (r"\.mlp\.down_proj\.weight$", ROW),
    (r"^lm_head\.weight$", VOCAB),
)
RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "llada": LLADA_RULES,
    "dream": QWEN_RULES,
    "sdar": QWEN_RULES,
}


def rules_for(family: str) -> tuple[tuple[str, str], ...]:
    """The family's table, or a clear error naming the setting for a family without one."""
    if family not in RULES:
        raise ValueError(
            f"tensor_parallel_size > 1 is not supported for the {family} family yet "
            f"(supported: {', '.join(sorted(RULES))}); serve it with tensor_parallel_size 1"
        )
    return RULES[family]


def kind_of(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    """How the published tensor `name` is split across ranks."""
    for pattern, kind in rules:
        if re.search(pattern, name):
            return kind
    return REPLICATED


def _split(n: int, world: int, what: str) -> int:
    if n % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide {what} ({n})")
    return n // world


def shard_model(model: nn.Module, family: str, world: int, group=None) -> None:
    """Turn a model built on the meta device into one rank's shard of it: column layers
    with 1/world of their outputs, row layers with 1/world of their inputs (all-reduced),
    the untied head over 1/world of the vocabulary, attention over 1/world of the heads."""
    rules = rules_for(family)
    for name, module in list(model.named_modules()):
        if hasattr(module, "n_heads") and hasattr(module, "n_kv_heads"):
            module.n_heads = _split(module.n_heads, world, f"{name} attention heads")
            module.n_kv_heads = _split(module.n_kv_heads, world, f"{name} key/value heads")
        if type(module) is not nn.Linear:
            continue
        kind = kind_of(f"{name}.weight", rules)
        bias = module.bias is not None
        if kind == COLUMN:
            out = _split(module.out_features, world, f"{name} outputs")
            new: nn.Linear = nn.Linear(module.in_features, out, bias=bias)
        elif kind == ROW:
            inp = _split(module.in_features, world, f"{name} inputs")
            new = RowParallelLinear(inp, module.out_features, bias, group)
        elif kind == VOCAB:
            new = VocabParallelHead(module.in_features, module.out_features, world, bias, group)
        else:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _slice(sl, kind: str, name: str, rank: int, world: int) -> torch.Tensor:
    """This rank's part of the safetensors slice `sl` (only those bytes are read)."""
    shape = sl.get_shape()
    if kind == COLUMN:
        n = shape[0] // world
        return sl[rank * n : (rank + 1) * n]
    if kind == ROW and len(shape) == 2:  # a row layer's bias is whole, added after the sum
        n = shape[1] // world
        return sl[:, rank * n : (rank + 1) * n]
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
    path: Path, family: str, rank: int, world: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of every published tensor, cast to `dtype` when floating."""
    rules = rules_for(family)
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = _slice(sf.get_slice(name), kind_of(name, rules), name, rank, world)
                t = t.to(dtype) if t.is_floating_point() else t
                state[name] = t.to(device)
    return state
