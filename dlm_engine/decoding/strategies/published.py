"""LLaDA's and Dream's published step-scheduled rules (LLaDA `generate.py` remasking;
Dream `diffusion_generate` alg): k positions a step, k from the block's step schedule."""

from __future__ import annotations

from ...errors import InvalidRequestError
from ...models import Family
from ..proposals import MARGIN, NEG_ENTROPY, RANDOM
from .base import ConfidenceRule


class _NoThreshold(ConfidenceRule):
    """A rule whose positions have no confidence in [0, 1] to compare with a threshold."""

    threshold_kind = "none"
    threshold_code = None

    def refuse_threshold(self, threshold: float | None) -> None:
        if threshold is not None:
            raise InvalidRequestError(
                "threshold", f"needs a confidence in [0, 1]; algorithm {self.name} has none"
            )


class LowConfidence(ConfidenceRule):
    name = "low_confidence"
    source = "LLaDA generate.py (remasking low_confidence)"


class Random(_NoThreshold):
    name = "random"
    source = "LLaDA generate.py (remasking random)"
    confidence = RANDOM
    needs_generator = True


class Origin(_NoThreshold):
    name = "origin"
    source = "Dream diffusion_generate (alg origin)"
    family_specific = True
    draws_positions = True
    needs_generator = True

    def family_refusal(self, family: Family) -> str:
        return "origin is Dream's algorithm; use low_confidence or random"


class MaskgitPlus(ConfidenceRule):
    name = "maskgit_plus"
    source = "Dream diffusion_generate (alg maskgit_plus)"


class TopkMargin(ConfidenceRule):
    name = "topk_margin"
    source = "Dream diffusion_generate (alg topk_margin)"
    confidence = MARGIN


class Entropy(_NoThreshold):
    name = "entropy"
    source = "Dream diffusion_generate (alg entropy)"
    confidence = NEG_ENTROPY


STRATEGIES = (LowConfidence(), Random(), Origin(), MaskgitPlus(), TopkMargin(), Entropy())
