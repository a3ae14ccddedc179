"""Model families, detected from a checkpoint's `config.json` (no trust_remote_code).

Each family is one `Family` value at the end of its model file; `FAMILIES` registers them in
detection order. Adding a family: its model file with its `FAMILY`, one line here."""

from __future__ import annotations

from typing import Any

from torch import nn

from . import diffusion_gemma, dream, fast_dllm_v2, llada, llada2, sdar, sdar_moe
from .family import D3LLMLoop, Family

LLADA = llada.FAMILY
DREAM = dream.FAMILY
SDAR = sdar.FAMILY
SDAR_MOE = sdar_moe.FAMILY
LLADA2 = llada2.FAMILY
DIFFUSION_GEMMA = diffusion_gemma.FAMILY
FAST_DLLM_V2 = fast_dllm_v2.FAMILY

# detection order: the first family whose `detect` accepts a config is its family (LLaDA2
# before LLaDA: "llada2moemodellm" also starts with "llada")
FAMILIES: tuple[Family, ...] = (
    DIFFUSION_GEMMA,
    SDAR_MOE,
    SDAR,
    LLADA2,
    FAST_DLLM_V2,
    LLADA,
    DREAM,
)


def detect_family(config: dict[str, Any]) -> Family:
    """The family from `model_type` / `architectures`, as the published configs name them."""
    for family in FAMILIES:
        if family.detect(config):
            return family
    raise ValueError(
        f"unsupported checkpoint: model_type={config.get('model_type')!r} "
        f"architectures={config.get('architectures')!r} "
        f"(supported: {', '.join(f.label for f in FAMILIES)})"
    )


def family_of(family: Family | str) -> Family:
    """The registered family, given as itself or by name."""
    if isinstance(family, Family):
        return family
    for f in FAMILIES:
        if f.name == family:
            return f
    raise ValueError(f"unknown model family {family!r} ({', '.join(f.name for f in FAMILIES)})")


def build_model(family: Family, config: dict[str, Any]) -> nn.Module:
    """An uninitialised model of the family's published layout."""
    return family_of(family).build(config)


__all__ = [
    "DIFFUSION_GEMMA",
    "DREAM",
    "FAMILIES",
    "FAST_DLLM_V2",
    "LLADA",
    "LLADA2",
    "SDAR",
    "SDAR_MOE",
    "D3LLMLoop",
    "Family",
    "build_model",
    "detect_family",
    "family_of",
]
