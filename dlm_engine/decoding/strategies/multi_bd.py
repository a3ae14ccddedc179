"""Diffulex's multi-block diffusion (block-diffusion models): a running set of up to
`buffer_size` blocks refined in one forward, each committing every confidence above
`threshold`; a block enters when its predecessor's progress passes `add_block_threshold`
and may force its best mask once the predecessor is `semi_complete_threshold` decoded."""

from __future__ import annotations

from typing import Any

from dlm_protocol.params import (
    DEFAULT_ADD_BLOCK_THRESHOLD,
    DEFAULT_BUFFER_SIZE,
    DEFAULT_SEMI_COMPLETE_THRESHOLD,
    DEFAULT_THRESHOLD,
)

from ..commit_rules import MULTI_BD
from .base import BlockStrategy


class MultiBD(BlockStrategy):
    name = "multi_bd"
    source = "Diffulex (diffulex/sampler, DecodingThresholds)"
    keys = ("buffer_size", "add_block_threshold", "semi_complete_threshold")
    code = MULTI_BD
    # the family's Diffulex sampler value (SDAR 0.95, LLaDA2 0.9), else Fast-dLLM's
    default_threshold = DEFAULT_THRESHOLD
    step_schedule = False

    def canvas_refusal(self) -> str:
        return "multi_bd (Diffulex) is for block-diffusion models (SDAR, LLaDA2)"

    def resolved_fields(self, p) -> dict[str, Any]:
        def pick(value, default):
            return default if value is None else value

        return {
            "buffer_size": pick(p.buffer_size, DEFAULT_BUFFER_SIZE),
            "add_block_threshold": pick(p.add_block_threshold, DEFAULT_ADD_BLOCK_THRESHOLD),
            "semi_complete_threshold": pick(
                p.semi_complete_threshold, DEFAULT_SEMI_COMPLETE_THRESHOLD
            ),
        }

    def init_row(self, seq, *, eos_id: int | None, stop_ids: frozenset[int]) -> None:
        from ..multi_bd import MultiBDState

        p = seq.params
        seq.mbd = MultiBDState(
            seq.layout,
            buffer_size=p.buffer_size,
            add_block_threshold=p.add_block_threshold,
            semi_complete_threshold=p.semi_complete_threshold,
            stop_ids=stop_ids,
        )


STRATEGIES = (MultiBD(),)
