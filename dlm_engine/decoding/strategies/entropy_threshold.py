"""d3LLM's entropy threshold (hao-ai-lab/d3LLM, SGLang PR #20615): every masked position whose
entropy is at most `threshold` nats (Dream's loop: below it), plus the lowest one. Decodes
in blocks of 32 by default on every family, as published; the rule of multi-block decoding."""

from __future__ import annotations

from ..commit_rules import ENTROPY
from .base import ConfidenceRule

DEFAULT_ENTROPY_THRESHOLD = 0.5  # d3LLM generate()/diffusion_generate(threshold=0.5)


class EntropyThreshold(ConfidenceRule):
    name = "entropy_threshold"
    source = "d3LLM generate / diffusion_generate (entropy threshold)"
    threshold_kind = "entropy"
    default_threshold = DEFAULT_ENTROPY_THRESHOLD
    code = ENTROPY
    threshold_code = None
    takes_alg_temp = False
    decodes_in_blocks = True
    multi_block_rule = True


STRATEGIES = (EntropyThreshold(),)
