"""Fast-dLLM's factor rule (NVlabs/Fast-dLLM llada/generate.py `get_transfer_index_dynamic`,
factor=1): the n most confident while c_i >= 1 - factor / (i + 2). Published for LLaDA."""

from __future__ import annotations

from typing import Any

from ...models import Family
from ..commit_rules import FACTOR
from .base import ConfidenceRule

DEFAULT_FACTOR = 1.0  # Fast-dLLM get_transfer_index_dynamic(factor=1)


class Factor(ConfidenceRule):
    name = "factor"
    source = "Fast-dLLM llada/generate.py (get_transfer_index_dynamic)"
    keys = ("factor",)
    implied_by_keys = True
    threshold_kind = "none"
    code = FACTOR
    threshold_code = None
    takes_alg_temp = False
    family_specific = True
    multi_block_rule = True

    def family_refusal(self, family: Family) -> str:
        return "factor is published for LLaDA (Fast-dLLM) only"

    def resolved_fields(self, p) -> dict[str, Any]:
        return {"factor": DEFAULT_FACTOR if p.factor is None else p.factor}


STRATEGIES = (Factor(),)
