"""Model families, detected from a checkpoint's `config.json` (no trust_remote_code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .dream import DreamArch, DreamModel
from .llada import LLaDAArch, LLaDAModel


@dataclass(frozen=True)
class Family:
    """What differs between families beyond tensor names: defaults and the special tokens."""

    name: str
    default_algorithm: str
    uses_blocks_by_default: bool
    mask_token: str
    end_of_turn_tokens: tuple[str, ...]


LLADA = Family("llada", "low_confidence", True, "<|mdm_mask|>", ("<|eot_id|>", "<|endoftext|>"))
DREAM = Family("dream", "entropy", False, "<|mask|>", ("<|im_end|>", "<|endoftext|>"))


def detect_family(config: dict[str, Any]) -> Family:
    """LLaDA or Dream from `model_type` / `architectures`, as the published configs name them."""
    model_type = str(config.get("model_type", "")).lower()
    archs = [str(a).lower() for a in config.get("architectures") or []]
    if model_type == "llada" or any(a.startswith("llada") for a in archs):
        return LLADA
    if model_type == "dream" or any(a.startswith("dream") for a in archs):
        return DREAM
    raise ValueError(
        f"unsupported checkpoint: model_type={config.get('model_type')!r} "
        f"architectures={config.get('architectures')!r} (supported: LLaDA, Dream)"
    )


def build_model(family: Family, config: dict[str, Any]) -> nn.Module:
    """An uninitialised model of the family's published layout."""
    if family is LLADA:
        return LLaDAModel(LLaDAArch.from_config(config))
    return DreamModel(DreamArch.from_config(config))


__all__ = ["DREAM", "LLADA", "Family", "build_model", "detect_family"]
