"""FP8 (e4m3) weights: per-output-channel weight scales, dynamic per-token activation scales.

A batch-1 denoising step reads every weight once, so halving the bytes of the weights roughly
halves the step. On GPUs with FP8 tensor cores (compute capability 8.9 and newer) the products
run through `torch._scaled_mm` / `torch._scaled_grouped_mm` (cuBLASLt / CUTLASS row-wise
scaling): activations are quantized per token on the fly, weights keep the scales they were
quantized or published with. Elsewhere (the CPU, older GPUs) the same layers compute the same
scheme by dequantizing, so an FP8 checkpoint loads and runs on every machine.

Two sources of FP8 weights:
- a bf16/fp32 checkpoint quantized at load (`--quantization fp8`): `quantize_rows` per output
  channel;
- a published FP8 checkpoint (`quantization_config` in config.json, compressed-tensors or
  transformers' `fp8` method): its e4m3 weights and scales are used as stored, never
  re-quantized (`load_fp8_checkpoint` in `fp8_checkpoint.py`).
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from .models.common import FusedKernels

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
_SCALE_FLOOR = 1e-12  # an all-zero row still gets a finite scale


def fp8_hardware(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 matrices natively (Ada, Hopper and newer)."""
    return device.type == "cuda" and _capable(device.index)


@cache
def _capable(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 scales of `w` [..., N, K], one scale per row (last dim reduced)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=-1) / E4M3_MAX).clamp(min=_SCALE_FLOOR)
    q = (wf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def _quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=_SCALE_FLOOR)
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


# tokens [M, K] -> (e4m3 [M, K], float32 scales [M, 1]); one fused kernel on the GPU
quantize_tokens = FusedKernels(_quantize_tokens)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 `q` [..., N, K] with per-row `scale` [..., N]."""
    return q.float() * scale[..., None]


def _emulated(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The scaled product computed without FP8 hardware: tokens quantized as the GPU path
    quantizes them, then a float32 product with the dequantized weight `w` [N, K]."""
    xq, xs = _quantize_tokens(x2)
    return F.linear(xq.float() * xs, w)


def fp8_like(linear: nn.Module, layer: Fp8Linear) -> Fp8Linear:
    """`layer`, the FP8 replacement of `linear`, as `linear`'s own FP8 kind where it has one:
    a tensor-parallel row layer (`parallel/layers.py`) answers `as_fp8` with a layer that
    still sums its partial products over the ranks."""
    as_fp8 = getattr(linear, "as_fp8", None)
    return as_fp8(layer) if as_fp8 is not None else layer


class Fp8Linear(nn.Module):
    """`nn.Linear` with e4m3 weights [N, K] and float32 scales: per output channel
    (`weight_scale` [N]) or per block (`block` = (bn, bk), `weight_scale` [N/bn, K/bk], as
    block-quantized checkpoints publish them)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense: torch.Tensor | None = None  # dequantized weight, where no FP8 hardware

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear` quantized per output channel (a tensor-parallel shard keeps its role:
        see `fp8_like`)."""
        q, scale = quantize_rows(linear.weight.data)
        bias = None if linear.bias is None else linear.bias.data
        return fp8_like(linear, cls(linear.in_features, linear.out_features, bias, q, scale))

    @classmethod
    def concat(cls, layers: list[Fp8Linear]) -> Fp8Linear:
        """Layers sharing an input stacked along the output (q/k/v, gate/up): per-channel
        scales concatenate exactly, and so do block scales of layers whose outputs are whole
        blocks of the same size."""
        block = layers[0].block
        if block is not None and any(
            layer.block != block or layer.weight_scale.dim() != 2 or layer.out_features % block[0]
            for layer in layers
        ):
            raise ValueError("block-scaled FP8 layers are fused only in whole blocks of one size")
        bias = None
        if layers[0].bias is not None:
            bias = torch.cat([layer.bias.data for layer in layers])
        return cls(
            layers[0].in_features,
            sum(layer.out_features for layer in layers),
            bias,
            torch.cat([layer.weight for layer in layers]),
            torch.cat([layer.weight_scale for layer in layers]),
            block,
        )

    def dequantized(self) -> torch.Tensor:
        """float32 weight [N, K]."""
        if self.block is None:
            return dequantize_rows(self.weight, self.weight_scale)
        bn, bk = self.block
        n, k = self.weight.shape
        s = self.weight_scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return self.weight.float() * s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x times the weight, without the bias (a row-parallel layer sums this over ranks
        first)."""
        x2 = x.reshape(-1, self.in_features)
        if self.block is None and fp8_hardware(x.device):
            xq, xs = quantize_tokens(x2)
            y = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=xs,
                scale_b=self.weight_scale.view(1, -1),
                out_dtype=x.dtype,
                use_fast_accum=True,
            )
        elif self.block is not None and x.device.type == "cuda":
            # block scales: dequantized per call (correct, not fast)
            y = F.linear(x2, self.dequantized().to(x.dtype))
        else:
            if self._dense is None:
                self._dense = self.dequantized()
            y = _emulated(x2, self._dense).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scales = "per channel" if self.block is None else f"per {self.block} block"
        return f"in={self.in_features}, out={self.out_features}, e4m3, scales {scales}"


class Fp8Experts(nn.Module):
    """Stacked expert weights for the grouped GEMMs in e4m3: `weight` [E, N, K] (each expert's
    output rows) and `weight_scale` [E, N]. `shape` is the [E, K, N] layout of the bf16
    stacked weights it replaces, so routing code reads it the same way."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self._dense: torch.Tensor | None = None
        self._grouped_failed = False

    @classmethod
    def from_stacked(cls, w: torch.Tensor) -> Fp8Experts:
        """From bf16 stacked weights [E, K, N] (the grouped GEMM's layout)."""
        return cls.from_linear_stacked(w.transpose(-2, -1))

    @classmethod
    def from_linear_stacked(cls, w: torch.Tensor) -> Fp8Experts:
        """From stacked weights in `F.linear` layout [E, N, K] (output rows, as DiffusionGemma
        publishes its experts): already one row per output channel."""
        q, scale = quantize_rows(w)
        return cls(q.contiguous(), scale)

    @property
    def shape(self) -> torch.Size:
        e, n, k = self.weight.shape
        return torch.Size((e, k, n))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized [E, K, N] in `dtype` (the fallback where FP8 grouped GEMMs don't run)."""
        if self._dense is None or self._dense.dtype != dtype:
            deq = dequantize_rows(self.weight, self.weight_scale).transpose(-2, -1)
            self._dense = deq.to(dtype).contiguous()
        return self._dense

    def grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] (rows sorted by expert, `offs` cumulative counts) times each row's expert,
        through the FP8 grouped GEMM; None where that kernel does not run here."""
        if self._grouped_failed or not fp8_hardware(x.device):
            return None
        try:
            xq, xs = quantize_tokens(x)
            return torch._scaled_grouped_mm(
                xq,
                self.weight.transpose(-2, -1),
                xs.view(-1),
                self.weight_scale,
                offs=offs,
                out_dtype=x.dtype,
                use_fast_accum=True,
            )
        except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
            log.warning("FP8 grouped GEMM unavailable (%s): experts run dequantized", exc)
            self._grouped_failed = True
            return None


# a module's own stacked MoE expert weights [E, ., .] that FP8 quantizes, by name: stored in
# the grouped GEMM's [E, in, out] layout, or in `F.linear`'s [E, out, in] (DiffusionGemma's)
EXPERT_STACKS = {
    "w_gate_up": "in_out",
    "w_down": "in_out",
    "gate_up_proj": "out_in",
    "down_proj": "out_in",
}


def quantize_fp8(model: nn.Module, head: nn.Module | None) -> int:
    """Replace every `nn.Linear` but the output head by an `Fp8Linear`, and stacked MoE
    expert weights (`EXPERT_STACKS`) by `Fp8Experts`; returns how many were replaced."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child is not head:
                setattr(parent, name, Fp8Linear.from_linear(child))
                swapped += 1
        for name, layout in EXPERT_STACKS.items():
            w = getattr(parent, name, None)  # a tensor: not a (quantized) linear layer
            if isinstance(w, torch.Tensor) and w.dim() == 3:
                delattr(parent, name)
                stacked = w.data if layout == "out_in" else w.data.transpose(-2, -1)
                setattr(parent, name, Fp8Experts.from_linear_stacked(stacked))
                swapped += 1
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return swapped
