"""Tensor-parallel linear layers: the pieces of a sharded model that talk to other ranks.

Column-parallel layers (q/k/v, gate/up) need no layer of their own: a rank's shard is a plain
`nn.Linear` with fewer outputs, so `fuse_projections` concatenates a rank's own q/k/v shards.
A row-parallel layer (attention output, MLP down) multiplies its slice of the inputs and sums
the partial products of all ranks (one all-reduce); the output head holds a slice of the
vocabulary and gathers the logits on rank 0, which alone decodes. In FP8 (a published FP8
checkpoint or `quantization=fp8`) a row layer becomes a `RowParallelFp8Linear`, which sums
its FP8 partial products the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..fp8 import Fp8Linear


class RowParallelLinear(nn.Linear):
    """`nn.Linear` over this rank's slice of the input features; the partial outputs of all
    ranks are summed by an all-reduce and the (replicated) bias is added once, after it."""

    def __init__(self, in_local: int, out_features: int, bias: bool, group=None) -> None:
        super().__init__(in_local, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias

    def as_fp8(self, layer: Fp8Linear) -> RowParallelFp8Linear:
        """This layer in FP8 (`layer`: its weights and scales), still summed over ranks."""
        return RowParallelFp8Linear(layer, self.group)


class RowParallelFp8Linear(Fp8Linear):
    """An `Fp8Linear` over this rank's slice of the input features, summed over ranks like
    `RowParallelLinear`. Its per-output-channel scales are the published ones (replicated on
    every rank) or, quantized at load, computed over this rank's columns only, and each
    token's activation scale over its slice of the inputs: the same scheme as one device
    with other rounding, so logits agree within FP8 rounding rather than bit for bit."""

    def __init__(self, layer: Fp8Linear, group=None) -> None:
        bias = None if layer.bias is None else layer.bias.data
        super().__init__(
            layer.in_features,
            layer.out_features,
            bias,
            layer.weight,
            layer.weight_scale,
            layer.block,
        )
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x).contiguous()
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Linear):
    """The output head over this rank's slice of the vocabulary (`shard` rows, the last
    rank's padded with zero rows when the vocabulary does not divide); rank 0 gathers every
    slice and returns the full logits, the other ranks return their own slice."""

    def __init__(self, in_features: int, vocab: int, world: int, bias: bool, group=None) -> None:
        self.vocab, self.world = vocab, world
        self.shard = -(-vocab // world)
        super().__init__(in_features, self.shard, bias=bias)
        self.group = group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight, self.bias).contiguous()
        if dist.get_rank(self.group) != 0:
            dist.gather(local, None, dst=0, group=self.group)
            return local
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]
