"""A rank's slices of a published FP8 checkpoint's weight scales, matching its weight slices.

A scale (`<layer>.weight_scale` or `.weight_scale_inv`, see `fp8_checkpoint.py`) is split as
its weight is: a column-parallel layer's per-channel scales with its output rows, a row-parallel
(or partial) layer's per-channel scales whole (each rank's rows are every output row); block
scales [N/bn, K/bk] by whole blocks, along the output-block axis for a column layer and along
the input-block axis for a row layer. A split that would cut a scale block is refused, naming
the layer. A per-tensor scale (and a static `input_scale`) is replicated. An FP8 output head
split by vocabulary is refused (checkpoints keep it in bf16). Under expert parallel a routed
expert's scales go whole with it (`sharding.py` renames them with its weights).
"""

from __future__ import annotations

import torch

from ..models.shard_rules import COLUMN, EXPERT, EXPERT_COLUMN, EXPERT_ROW, PARTIAL, QKV, ROW, VOCAB

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")

Parts = list[tuple[slice, slice]]  # (rows, columns) pieces, concatenated along the rows


def weight_of(name: str) -> str | None:
    """The weight a published scale `name` belongs to; None when `name` is no FP8 scale."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight"
    return None


def _whole(n: int, size: int, world: int, layer: str, what: str) -> int:
    """Blocks of a rank's `n // world` rows (or columns), each `size` long: refused when the
    split cuts one."""
    local = n // world
    if local % size:
        raise ValueError(
            f"{layer}: tensor_parallel_size {world} gives each rank {local} of its {n} {what}, "
            f"which cuts its FP8 scale blocks of {size}; serve it with a tensor_parallel_size "
            f"whose slices are whole blocks"
        )
    return local // size


def scale_parts(
    name: str,
    shape: list[int],
    weight_shape: list[int],
    kind: str,
    rank: int,
    world: int,
    block: tuple[int, int] | None,
    qkv: tuple[int, int] | None,
) -> Parts | None:
    """Which part of the scale `name` (of `shape`, for a weight of `weight_shape` split as
    `kind`) rank `rank` reads; None: the whole tensor."""
    layer = name.rpartition(".")[0]
    numel = 1
    for d in shape:
        numel *= d
    if numel == 1 or kind == EXPERT:
        return None
    if kind == VOCAB:
        raise ValueError(
            f"{layer}: an FP8 output head is not supported with tensor_parallel_size {world}"
        )
    if kind in (EXPERT_COLUMN, EXPERT_ROW):  # `start.check_supported` refuses these first
        raise ValueError(
            f"{layer}: FP8 stacked experts are not supported with tensor_parallel_size {world}"
        )
    blocked = block is not None and len(shape) == 2 and numel > 1
    bn, bk = block if blocked and block is not None else (1, 1)
    n_out, n_in = weight_shape[0], weight_shape[-1]
    every = slice(None)
    if kind == COLUMN:
        r = _whole(n_out, bn, world, layer, "output rows")
        return [(slice(rank * r, (rank + 1) * r), every)]
    if kind == QKV and qkv is not None:
        q_rows, kv_rows = qkv
        q = _whole(q_rows, bn, world, layer, "query rows")
        kv = _whole(kv_rows, bn, world, layer, "key/value rows")
        q_blocks, kv_blocks = q_rows // bn, kv_rows // bn
        starts = (rank * q, q_blocks + rank * kv, q_blocks + kv_blocks + rank * kv)
        return [(slice(a, a + n), every) for a, n in zip(starts, (q, kv, kv), strict=True)]
    if kind in (ROW, PARTIAL) and blocked:
        c = _whole(n_in, bk, world, layer, "input columns")
        return [(every, slice(rank * c, (rank + 1) * c))]
    return None  # per-channel scales of a row layer, or a replicated layer


def read_scale(sl, parts: Parts | None) -> torch.Tensor:
    """Read `parts` of the safetensors slice `sl` (only those bytes)."""
    if parts is None:
        return sl[:]
    two_d = len(sl.get_shape()) == 2
    return torch.cat([sl[rows, cols] if two_d else sl[rows] for rows, cols in parts])
