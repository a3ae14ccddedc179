"""Published 4-bit checkpoints (GPTQ as GPTQModel/AutoGPTQ write them, AWQ's GEMM layout):
their integers, scales and zero points loaded as stored, never re-quantized.

`quantization_config` in config.json names the method:
- `gptq` (`bits` 4, `group_size`, `desc_act`, `sym`, `checkpoint_format` gptq or gptq_v2):
  `<layer>.qweight` int32 [K/8, N] (eight inputs to an int32, input 8i + j in bits 4j..4j+3),
  `<layer>.qzeros` int32 [K/group, N/8] (packed along the outputs the same way; the `gptq`
  format stores each zero point minus one), `<layer>.scales` float16 [K/group, N] and
  `<layer>.g_idx` int32 [K] (the group of each input; act-order checkpoints permute them);
- `awq` (`version` gemm, `zero_point`): `qweight` int32 [K, N/8] and `qzeros` [K/group, N/8]
  packed along the outputs in AWQ's interleaved order, `scales` float16 [K/group, N].
Each becomes an `int4.Int4Linear` whose weight is `(q - zero) * scale`, as the publisher's
kernels compute it. Layers stored unquantized (usually the head) stay as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .int4 import Int4Linear, pack_rows, unpack_cols, unpack_rows

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
# AWQ packs output columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7 of each int32
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Int4Format:
    """How a checkpoint packs its 4-bit layers."""

    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group per output channel
    zero_offset: int  # added to each stored zero point (1 in GPTQ's v1 format)


def int4_format(config: dict[str, Any]) -> Int4Format | None:
    """The 4-bit format `config.json` declares; None when it declares no GPTQ/AWQ method.
    Anything these layers cannot compute exactly is refused by name."""
    qc = config.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        return None
    bits = int(qc.get("bits", qc.get("w_bit", 0)))
    if bits != 4:
        raise ValueError(f"quantization_config.bits {bits}: only 4-bit {method} checkpoints load")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"quantization_config.checkpoint_format {fmt!r} is not supported "
                "(gptq and gptq_v2 load)"
            )
        return Int4Format("gptq", group, 1 if fmt == "gptq" else 0)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r}: only AWQ's gemm layout loads")
    if qc.get("zero_point", True) is False:
        raise ValueError("quantization_config.zero_point false: AWQ without zero points")
    return Int4Format("awq", group, 0)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, N/8] -> uint8 [R, N] in column order."""
    q = unpack_cols(packed)  # nibble order
    r, n = q.shape
    order = torch.tensor(_AWQ_ORDER, device=q.device)
    out = torch.empty_like(q).view(r, n // 8, 8)
    out[:, :, order] = q.view(r, n // 8, 8)  # nibble j holds column _AWQ_ORDER[j]
    return out.view(r, n)


def _input_order(g_idx: torch.Tensor | None, k: int, group: int) -> torch.Tensor | None:
    """None when `g_idx` is the plain order (input i in group i // group); else the order
    that makes each group contiguous (act-order checkpoints)."""
    plain = torch.arange(k, device=g_idx.device if g_idx is not None else None) // group
    if g_idx is None or torch.equal(g_idx.to(plain.dtype), plain):
        return None
    perm = torch.argsort(g_idx.to(torch.int64), stable=True)
    if not torch.equal(g_idx.to(torch.int64)[perm], plain.to(torch.int64)):
        raise ValueError(f"g_idx does not put {group} inputs in each group")
    return perm


def _gptq_layer(
    state: dict[str, torch.Tensor], path: str, k: int, n: int, fmt: Int4Format
) -> Int4Linear:
    group = k if fmt.group_size == -1 else fmt.group_size
    qweight = state.pop(f"{path}.qweight")
    zeros = unpack_cols(state.pop(f"{path}.qzeros"))[:, :n].to(torch.int32) + fmt.zero_offset
    scales = state.pop(f"{path}.scales")
    perm = _input_order(state.pop(f"{path}.g_idx", None), k, group)
    if tuple(qweight.shape) != (k // 8, n):
        raise ValueError(f"{path}.qweight is {tuple(qweight.shape)}, expected {(k // 8, n)}")
    if perm is not None:  # inputs regrouped: the same integers, stored in group order
        qweight = pack_rows(unpack_rows(qweight)[perm])
    return Int4Linear(k, n, qweight, scales, zeros.to(torch.uint8), group, perm=perm)


def _awq_layer(
    state: dict[str, torch.Tensor], path: str, k: int, n: int, fmt: Int4Format
) -> Int4Linear:
    group = k if fmt.group_size == -1 else fmt.group_size
    q = _awq_columns(state.pop(f"{path}.qweight"))
    if tuple(q.shape) != (k, n):
        raise ValueError(f"{path}.qweight unpacks to {tuple(q.shape)}, expected {(k, n)}")
    zeros = _awq_columns(state.pop(f"{path}.qzeros"))
    return Int4Linear(k, n, pack_rows(q), state.pop(f"{path}.scales"), zeros, group)


def install_int4_layers(
    model: nn.Module, state: dict[str, torch.Tensor], fmt: Int4Format, dtype: torch.dtype
) -> int:
    """Swap each `nn.Linear` stored as 4-bit in `state` for an `Int4Linear` built from the
    stored tensors, and put its buffers in `state` under the layer's name, so
    `load_state_dict(assign=True)` keeps them; returns how many layers. MoE experts (stacked
    for the grouped GEMMs) get their dequantized weights in `dtype` instead."""
    build = _gptq_layer if fmt.method == "gptq" else _awq_layer
    swapped = dense = 0
    for name in [n for n in state if n.endswith(".qweight")]:
        path = name.removesuffix(".qweight")
        parent_name, _, child_name = path.rpartition(".")
        linear = getattr(model.get_submodule(parent_name), child_name, None)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is 4-bit but {path} is not a linear layer")
        for part in ("qzeros", "scales"):
            if f"{path}.{part}" not in state:
                raise ValueError(f"checkpoint stores {name} but no {path}.{part}")
        layer = build(state, path, linear.in_features, linear.out_features, fmt)
        if ".experts." in path:
            state[f"{path}.weight"] = layer.dequantized().to(dtype)
            dense += 1
            continue
        bias = state.pop(f"{path}.bias", None)
        if bias is not None:
            layer.bias = nn.Parameter(bias, requires_grad=False)
        setattr(model.get_submodule(parent_name), child_name, layer)
        state.update({f"{path}.{k}": v for k, v in layer.state_dict().items()})
        swapped += 1
    log.info(
        "%s checkpoint: %d linear layers kept in int4 as stored, %d experts dequantized",
        fmt.method,
        swapped,
        dense,
    )
    return swapped
