"""4-bit integer weights with 16-bit activations (W4A16): groups of inputs share a scale and
a zero point, `w = (q - zero) * scale` with `q` in 0..15.

The weights take a quarter of bf16's bytes (plus a float16 scale and a zero point per group),
so an 8B model's weights take under 6 GB. Speed: a step that reads each weight once could take a
quarter of bf16's read time, but a diffusion step feeds 32 tokens and more, where the products
are bound by the tensor cores; the kernels (`int4_kernels.py`) take about bf16's time at a
few tokens and more beyond, so int4 is the memory path, not the fast one (docs/benchmarks.md).

Two sources of int4 weights, one layer type (`Int4Linear`):
- a bf16/fp32 checkpoint quantized at load (`--quantization int4`): asymmetric round-to-nearest
  per group of 128 inputs (`quantize_groups`);
- a published GPTQ or AWQ checkpoint: its integers, scales and zero points used as stored, only
  unpacked into the layout the kernels read (`gptq_checkpoint.py`).

On CUDA the products run through the Triton kernels of `int4_kernels.py`, chosen by the number
of token rows; elsewhere (the CPU) the layer dequantizes its weight once and multiplies densely,
so the same checkpoints load and give the same numbers on every machine.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

GROUP_SIZE = 128  # inputs sharing one scale and zero point (GPTQ's and AWQ's usual size)
_SHIFTS = tuple(range(0, 32, 4))  # nibble j of an int32 sits at bit 4 * j


def group_size_for(in_features: int, group: int = GROUP_SIZE) -> int:
    """`group` where it divides the inputs, else one group per output channel."""
    return group if in_features % group == 0 else in_features


def quantize_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest int4 of `w` [N, K] per `group` inputs: (q uint8 [N, K] in
    0..15, scales float16 [N, K/group], zeros uint8 [N, K/group]). The range always holds 0,
    so a zero weight stays exactly zero (GPTQ's convention)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo = wg.amin(-1).clamp(max=0.0)
    hi = wg.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()  # rounded as stored
    zero = (-lo / scale).round().clamp(0, 15)
    q = (wg / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale.half(), zero.to(torch.uint8)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor(_SHIFTS, dtype=torch.int32, device=device)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 [K, N] in 0..15 -> int32 [K/8, N]: nibble j of row i holds input 8i + j (the
    layout the kernels read, which is also GPTQ's `qweight`)."""
    k, n = q.shape
    wide = q.to(torch.int64).reshape(k // 8, 8, n) << _shifts(q.device).to(torch.int64)[:, None]
    packed = wide.sum(1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> uint8 [K, N], the inverse of `pack_rows`."""
    rows, n = packed.shape
    q = (packed[:, None, :] >> _shifts(packed.device)[:, None]) & 0xF
    return q.reshape(rows * 8, n).to(torch.uint8)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] -> uint8 [R, N]: nibble j of column i is column 8i + j (GPTQ's
    `qzeros`)."""
    r, cols = packed.shape
    q = (packed[:, :, None] >> _shifts(packed.device)) & 0xF
    return q.reshape(r, cols * 8).to(torch.uint8)


@cache
def _kernels_or_none():
    """The Triton kernels, or None where Triton does not import (then CUDA runs dequantized)."""
    try:
        from . import int4_kernels
    except ImportError as exc:
        log.warning("Triton unavailable (%s): int4 layers run dequantized", exc)
        return None
    return int4_kernels


class Int4Linear(nn.Module):
    """`nn.Linear` with int4 weights packed eight to an int32 along the inputs (`qweight`
    [K/8, N]), per-group float16 `scales` and uint8 `zeros` [K/group, N].

    `perm` [K], when set, is the order the inputs are stored in (GPTQ's act-order checkpoints
    group inputs by importance): the layer reads its input in that order, so each group stays
    contiguous for the kernels."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        k, n = in_features, out_features
        if k % 8 or k % group_size or tuple(qweight.shape) != (k // 8, n):
            raise ValueError(f"int4 weight {tuple(qweight.shape)} does not fit a {k}x{n} layer")
        if tuple(scales.shape) != (k // group_size, n) or scales.shape != zeros.shape:
            raise ValueError(f"int4 scales {tuple(scales.shape)} do not fit groups of {group_size}")
        self.in_features, self.out_features, self.group_size = k, n, group_size
        self.register_buffer("qweight", qweight.to(torch.int32).contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("zeros", zeros.to(torch.uint8).contiguous())
        self.register_buffer("perm", None if perm is None else perm.to(torch.int64))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense: torch.Tensor | None = None  # dequantized weight, off CUDA

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = GROUP_SIZE) -> Int4Linear:
        """Quantize a dense layer: round-to-nearest per group (`quantize_groups`)."""
        group = group_size_for(linear.in_features, group)
        q, scales, zeros = quantize_groups(linear.weight.data, group)
        bias = None if linear.bias is None else linear.bias.data
        return cls(
            linear.in_features,
            linear.out_features,
            pack_rows(q.t().contiguous()),
            scales.t(),
            zeros.t(),
            group,
            bias,
        )

    @classmethod
    def concat(cls, layers: list[Int4Linear]) -> Int4Linear:
        """Layers sharing an input stacked along the outputs (q/k/v, gate/up): the packed
        columns, scales and zeros concatenate exactly."""
        first = layers[0]
        for layer in layers[1:]:
            same_perm = (layer.perm is None and first.perm is None) or (
                layer.perm is not None
                and first.perm is not None
                and torch.equal(layer.perm, first.perm)
            )
            if layer.group_size != first.group_size or not same_perm:
                raise ValueError("int4 layers with different groups or input orders do not fuse")
        bias = None
        if first.bias is not None:
            bias = torch.cat([layer.bias.data for layer in layers])
        return cls(
            first.in_features,
            sum(layer.out_features for layer in layers),
            torch.cat([layer.qweight for layer in layers], 1),
            torch.cat([layer.scales for layer in layers], 1),
            torch.cat([layer.zeros for layer in layers], 1),
            first.group_size,
            bias,
            first.perm,
        )

    def _stored_dense(self) -> torch.Tensor:
        """float32 weight [N, K] with the inputs in stored order (`perm`)."""
        q = unpack_rows(self.qweight).float()
        groups = torch.arange(self.in_features, device=q.device) // self.group_size
        return ((q - self.zeros[groups].float()) * self.scales[groups].float()).t()

    def dequantized(self) -> torch.Tensor:
        """float32 weight [N, K] in the layer's input order."""
        w = self._stored_dense()
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm, w)  # stored input i is perm[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:  # inputs in stored order, on every device alike
            x2 = x2.index_select(1, self.perm)
        kernels = _kernels_or_none() if x.device.type == "cuda" else None
        if kernels is not None:
            y = kernels.matmul(x2, self.qweight, self.scales, self.zeros, self.group_size)
        elif x.device.type == "cuda":  # no Triton: correct, not fast, no dense copy kept
            y = F.linear(x2, self._stored_dense().to(x.dtype))
        else:
            if self._dense is None or self._dense.dtype != x.dtype:
                self._dense = self._stored_dense().to(x.dtype)
            y = F.linear(x2, self._dense)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        order = ", act-order" if self.perm is not None else ""
        return (
            f"in={self.in_features}, out={self.out_features}, int4, "
            f"groups of {self.group_size}{order}"
        )


def quantize_int4(model: nn.Module, head: nn.Module | None, group: int = GROUP_SIZE) -> int:
    """Replace every `nn.Linear` but the output head by an `Int4Linear`; returns how many.
    Stacked MoE expert weights, and layers whose inputs do not pack eight to an int32, stay
    in the model dtype."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child is not head and child.in_features % 8 == 0:
                setattr(parent, name, Int4Linear.from_linear(child, group))
                swapped += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return swapped
