"""SDAR's remasking strategies (JetAstra/SDAR generate.py `block_diffusion_generate`), the
block-diffusion models' rules; LLaDA2's published `generate()` threshold rule is
`low_confidence_dynamic`. `steps` counts steps per block; k is the block's schedule."""

from __future__ import annotations

from dlm_protocol.params import DEFAULT_THRESHOLD

from ...errors import InvalidRequestError
from ...models import Family
from ..commit_rules import BOUNDED, DYNAMIC, RANK, SEQUENTIAL
from .base import BlockStrategy

DEFAULT_EB_THRESHOLD = 0.35  # SDAR generate.py eb_threshold


class LowConfidenceDynamic(BlockStrategy):
    name = "low_confidence_dynamic"
    source = "SDAR generate.py (low_confidence_dynamic); LLaDA2 generate() (threshold)"
    code = DYNAMIC
    # the family's published threshold (SDAR 0.85, LLaDA2 0.95), else Fast-dLLM's
    default_threshold = DEFAULT_THRESHOLD


class LowConfidenceStatic(BlockStrategy):
    name = "low_confidence_static"
    source = "SDAR generate.py (low_confidence_static)"
    code = RANK
    threshold_kind = "none"


class Sequential(BlockStrategy):
    name = "sequential"
    source = "SDAR generate.py (sequential)"
    code = SEQUENTIAL
    threshold_kind = "none"


class EntropyBounded(BlockStrategy):
    name = "entropy_bounded"
    source = "SDAR generate.py (entropy_bounded)"
    code = BOUNDED
    threshold_kind = "entropy"  # a bound on the sum of entropies, in nats
    default_threshold = DEFAULT_EB_THRESHOLD

    def check(self, p, *, family: Family, steps: int, block: int) -> None:
        if steps + 1 < block:
            # SDAR's loop gives a block steps + 1 forwards and then leaves it, masks and all
            # (its keys never cached); one commit a forward fills it only with steps >= block - 1
            raise InvalidRequestError(
                "steps",
                f"entropy_bounded: SDAR leaves a block after steps + 1 forwards even with masks "
                f"left; give steps >= block_length - 1 ({block - 1}) or another algorithm",
            )


STRATEGIES = (LowConfidenceDynamic(), LowConfidenceStatic(), Sequential(), EntropyBounded())
