"""Quantization of the transformer's linear layers at load.

`fp8`: e4m3 weights with per-channel scales and per-token activation scales (`fp8.py`); native
FP8 products on Ada/Hopper GPUs, dequantized elsewhere, the MoE experts included.
`int4`: 4-bit integer weights in groups of 128 with 16-bit activations (`int4.py`): Triton
kernels on CUDA, dequantized elsewhere; the MoE experts stay in the model dtype. A quarter of
bf16's weight bytes, faster than `nf4`; GPTQ/AWQ checkpoints load into the same layers.
`int8` (LLM.int8) and `nf4`: bitsandbytes weight-only layers, CUDA only.
Each replaces the `nn.Linear` layers inside the blocks (fused or not); the embeddings and the
output head stay in the model dtype, as is usual for these schemes.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED = ("fp8", "int4", "int8", "nf4")


def _output_head(model: nn.Module) -> nn.Module | None:
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(getattr(model.model, "transformer", None), "ff_out", None)
    return head


def quantize_linears(model: nn.Module, scheme: str, device: torch.device) -> int:
    """Swap the blocks' linear layers for quantized layers on `device`; returns how many."""
    if scheme not in SUPPORTED:
        raise ValueError(f"quantization must be one of {SUPPORTED}, got {scheme!r}")
    if scheme == "fp8":
        from .fp8 import quantize_fp8

        return quantize_fp8(model, _output_head(model))
    if scheme == "int4":
        from .int4 import quantize_int4

        return quantize_int4(model, _output_head(model))
    if device.type != "cuda":
        raise ValueError("bitsandbytes quantization needs a CUDA device")
    import bitsandbytes as bnb  # heavy and GPU-only: imported only when asked for

    head = _output_head(model)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child is head:
                continue
            has_bias = child.bias is not None
            if scheme == "int8":
                layer = bnb.nn.Linear8bitLt(
                    child.in_features,
                    child.out_features,
                    bias=has_bias,
                    has_fp16_weights=False,
                    threshold=6.0,
                )
                # Int8Params quantizes when moved from the CPU to the GPU
                layer.weight = bnb.nn.Int8Params(
                    child.weight.data.cpu(), requires_grad=False, has_fp16_weights=False
                )
            else:
                layer = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=has_bias,
                    compute_dtype=child.weight.dtype,
                    quant_type="nf4",
                )
                layer.weight = bnb.nn.Params4bit(
                    child.weight.data, requires_grad=False, quant_type="nf4"
                )
            if has_bias:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer.to(device))
            swapped += 1
            del child
    torch.cuda.empty_cache()
    return swapped


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take on their device (quantized layers keep theirs in
    buffers: e4m3 or packed int4 values and scales), for the ready line and `dlm_model_info`."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
