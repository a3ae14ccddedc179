"""Weight-only quantization of the transformer's linear layers with bitsandbytes.

INT8 (LLM.int8) and NF4 keep the published module tree; only `nn.Linear` leaves inside the
blocks are swapped, so the embeddings and the output head stay in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED = ("int8", "nf4")


def quantize_linears(model: nn.Module, scheme: str, device: torch.device) -> None:
    """Replace the blocks' `nn.Linear` layers in place with bitsandbytes layers on `device`."""
    if scheme not in SUPPORTED:
        raise ValueError(f"quantization must be one of {SUPPORTED}, got {scheme!r}")
    if device.type != "cuda":
        raise ValueError("bitsandbytes quantization needs a CUDA device")
    import bitsandbytes as bnb  # heavy and GPU-only: imported only when asked for

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                not isinstance(child, nn.Linear)
                or name in ("ff_out", "lm_head")
                and parent is not None
                and _is_head(model, child)
            ):
                continue
            dtype = child.weight.dtype
            bias = child.bias is not None
            if scheme == "int8":
                q = bnb.nn.Linear8bitLt(
                    child.in_features,
                    child.out_features,
                    bias=bias,
                    has_fp16_weights=False,
                    threshold=6.0,
                )
                q.weight = bnb.nn.Int8Params(
                    child.weight.data.cpu(), requires_grad=False, has_fp16_weights=False
                )
            else:
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=bias,
                    compute_dtype=dtype,
                    quant_type="nf4",
                )
                q.weight = bnb.nn.Params4bit(
                    child.weight.data.cpu(), requires_grad=False, quant_type="nf4"
                )
            if bias:
                q.bias = nn.Parameter(child.bias.data.cpu(), requires_grad=False)
            setattr(parent, name, q.to(device))
            del child
    torch.cuda.empty_cache()


def _is_head(model: nn.Module, layer: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    if head is None:
        head = getattr(getattr(model.model, "transformer", None), "ff_out", None)
    return layer is head
