"""Model families, detected from a checkpoint's `config.json` (no trust_remote_code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .diffusion_gemma import DiffusionGemmaArch, DiffusionGemmaModel, is_diffusion_gemma
from .dream import DreamArch, DreamModel
from .llada import LLaDAArch, LLaDAModel
from .llada2 import LLaDA2Arch, LLaDA2Model
from .sdar import SDARArch, SDARModel


@dataclass(frozen=True)
class Family:
    """What differs between families beyond tensor names: defaults and the special tokens.

    Block-diffusion families (SDAR, LLaDA2) attend block-causally: a token sees its own block
    and the blocks before it, in blocks of `default_block_length` tokens."""

    name: str
    default_algorithm: str
    uses_blocks_by_default: bool
    mask_token: str
    end_of_turn_tokens: tuple[str, ...]
    block_diffusion: bool = False
    default_block_length: int = 0
    uniform_diffusion: bool = False  # no mask token: canvases of random tokens (DiffusionGemma)
    tool_format: str = "hermes"


LLADA = Family("llada", "low_confidence", True, "<|mdm_mask|>", ("<|eot_id|>", "<|endoftext|>"))
DREAM = Family("dream", "entropy", False, "<|mask|>", ("<|im_end|>", "<|endoftext|>"))
# SDAR: Qwen3 tokenizer and chat template; blocks of 4 (config `block_size`), decoded with the
# published generate.py's default remasking strategy.
SDAR = Family(
    "sdar",
    "low_confidence_dynamic",
    True,
    "<|MASK|>",
    ("<|im_end|>", "<|endoftext|>"),
    block_diffusion=True,
    default_block_length=4,
)
# LLaDA2: Ling 2.0 tokenizer, `<role>HUMAN</role>...<|role_end|>` turns; blocks of 32 with
# confidence-threshold decoding, as the published `generate()` does.
LLADA2 = Family(
    "llada2",
    "threshold",
    True,
    "<|mask|>",
    ("<|role_end|>", "<|endoftext|>"),
    block_diffusion=True,
    default_block_length=32,
)
# DiffusionGemma: uniform-state diffusion over canvases (models/diffusion_gemma.py,
# decoding/uniform_diffusion.py); Gemma's tokenizer, turns end with <end_of_turn>.
DIFFUSION_GEMMA = Family(
    "diffusion_gemma",
    "uniform",
    False,
    "",
    ("<end_of_turn>", "<turn|>", "<|tool_response>"),
    uniform_diffusion=True,
    tool_format="gemma4",
)


def detect_family(config: dict[str, Any]) -> Family:
    """The family from `model_type` / `architectures`, as the published configs name them."""
    model_type = str(config.get("model_type", "")).lower()
    archs = [str(a).lower() for a in config.get("architectures") or []]
    if is_diffusion_gemma(config):
        return DIFFUSION_GEMMA
    if model_type == "sdar" or "sdarforcausallm" in archs:
        return SDAR
    # before LLaDA: "llada2moemodellm" also starts with "llada"
    if model_type == "llada2_moe" or "llada2moemodellm" in archs:
        return LLADA2
    if model_type == "llada" or any(a.startswith("llada") for a in archs):
        return LLADA
    if model_type == "dream" or any(a.startswith("dream") for a in archs):
        return DREAM
    raise ValueError(
        f"unsupported checkpoint: model_type={config.get('model_type')!r} "
        f"architectures={config.get('architectures')!r} "
        "(supported: LLaDA, Dream, SDAR, LLaDA2, DiffusionGemma)"
    )


def build_model(family: Family, config: dict[str, Any]) -> nn.Module:
    """An uninitialised model of the family's published layout."""
    if family is LLADA:
        return LLaDAModel(LLaDAArch.from_config(config))
    if family is SDAR:
        return SDARModel(SDARArch.from_config(config))
    if family is LLADA2:
        return LLaDA2Model(LLaDA2Arch.from_config(config))
    if family is DIFFUSION_GEMMA:
        return DiffusionGemmaModel(DiffusionGemmaArch.from_config(config))
    return DreamModel(DreamArch.from_config(config))


__all__ = [
    "DIFFUSION_GEMMA",
    "DREAM",
    "LLADA",
    "LLADA2",
    "SDAR",
    "Family",
    "build_model",
    "detect_family",
]
