"""Fast-dLLM's threshold rule (NVlabs/Fast-dLLM llada/generate.py `get_transfer_index`):
every masked position whose confidence is at least `threshold`, and at least the best.
Its last forward under `max_nfe` commits the rest of the block by rank."""

from __future__ import annotations

from dlm_protocol.params import DEFAULT_THRESHOLD

from .base import ConfidenceRule


class Threshold(ConfidenceRule):
    name = "threshold"
    source = "Fast-dLLM llada/generate.py (get_transfer_index, threshold)"
    default_threshold = DEFAULT_THRESHOLD
    multi_block_rule = True


STRATEGIES = (Threshold(),)
