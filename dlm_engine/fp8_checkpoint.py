"""Published FP8 checkpoints: their e4m3 weights and scales loaded as stored.

Two publishing formats are read from `quantization_config` in config.json:
- compressed-tensors (`quant_method: compressed-tensors`, as RedHatAI and llm-compressor write
  them): `<layer>.weight` in e4m3 with `<layer>.weight_scale` per tensor, per output channel
  or per block (`strategy` tensor / channel / block); static `input_scale`s are not used
  (activations are scaled per token at run time, which is at least as accurate);
- transformers' fine-grained FP8 (`quant_method: fp8`): `<layer>.weight_scale_inv` per
  `weight_block_size` block (or per tensor).
Layers named in the config's ignore list stay as stored (usually the head and the router).
Under tensor parallelism each rank reads its slices of the weights and the matching slices of
their scales (`parallel/sharding.py`); a row-parallel layer stays row-parallel in FP8.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fp8 import E4M3, Fp8Linear, fp8_like

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Format:
    """Where a checkpoint keeps its weight scales and how they are laid out."""

    scale_suffix: str  # "weight_scale" or "weight_scale_inv"
    block: tuple[int, int] | None  # (rows, columns) per scale; None: per tensor or channel


def fp8_format(config: dict[str, Any]) -> Fp8Format | None:
    """The FP8 format `config.json` declares; None for an unquantized checkpoint. Other
    quantization methods are refused by name (nothing would load them correctly)."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        return Fp8Format("weight_scale_inv", tuple(block) if block else None)
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if not weights or any(
            w.get("type") != "float" or int(w.get("num_bits", 0)) != 8 for w in weights
        ):
            raise ValueError(
                "quantization_config: only FP8 (float, 8-bit) compressed-tensors weights load"
            )
        strategy = weights[0].get("strategy", "tensor")
        block = weights[0].get("block_structure") if strategy == "block" else None
        return Fp8Format("weight_scale", tuple(block) if block else None)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported "
        "(FP8 checkpoints load: compressed-tensors and fp8)"
    )


def _scale_as_loaded(scale: torch.Tensor, out_features: int, fmt: Fp8Format) -> torch.Tensor:
    """Per-channel [N] scales (a per-tensor scale repeated: the same numbers), or the block
    grid [N/bn, K/bk] as published."""
    scale = scale.float()
    if fmt.block is not None and scale.dim() == 2 and scale.numel() > 1:
        return scale
    if scale.numel() == 1:
        return scale.reshape(1).expand(out_features).contiguous()
    return scale.reshape(out_features)


def install_fp8_layers(model: nn.Module, state: dict[str, torch.Tensor], fmt: Fp8Format) -> int:
    """Swap each `nn.Linear` whose stored weight is e4m3 for an `Fp8Linear` (still on the meta
    device) and rename its scale in `state`, so `load_state_dict` fills it as stored."""
    swapped = 0
    for name in [n for n, t in state.items() if n.endswith(".weight") and t.dtype == E4M3]:
        path = name.removesuffix(".weight")
        scale_name = f"{path}.{fmt.scale_suffix}"
        if scale_name not in state:
            raise ValueError(f"checkpoint stores {name} in FP8 but no {scale_name}")
        parent_name, _, child_name = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child_name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is FP8 but {path} is not a linear layer")
        scale = _scale_as_loaded(state.pop(scale_name), linear.out_features, fmt)
        state[f"{path}.weight_scale"] = scale
        block = fmt.block if scale.dim() == 2 else None
        placeholder = fp8_like(
            linear,
            Fp8Linear(
                linear.in_features,
                linear.out_features,
                None if linear.bias is None else torch.empty_like(linear.bias, device="meta"),
                torch.empty(linear.weight.shape, dtype=E4M3, device="meta"),
                torch.empty(scale.shape, device="meta"),
                block,
            ),
        )
        setattr(parent, child_name, placeholder)
        swapped += 1
    for name in [n for n in state if n.endswith(".input_scale")]:
        del state[name]  # static activation scales: activations are scaled per token instead
    log.info("FP8 checkpoint: %d linear layers kept in e4m3 as stored", swapped)
    return swapped
