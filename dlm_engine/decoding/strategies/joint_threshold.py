"""LLaDA2.1's token editing (SGLang JointThreshold): masks whose confidence passes
`threshold` are committed, and decoded tokens of the block whose replacement passes
`edit_threshold` are rewritten; a block ends after a step that changes nothing, or after
`max_post_edit_steps` edit-only steps."""

from __future__ import annotations

from typing import Any

from ...errors import InvalidRequestError
from ...models import Family
from ..commit_rules import JOINT
from .base import BlockStrategy

# SGLang JointThreshold: threshold 0.5, edit_threshold 0.0, max_post_edit_steps 16
DEFAULT_JOINT_THRESHOLD = 0.5
DEFAULT_EDIT_THRESHOLD = 0.0
DEFAULT_POST_EDIT_STEPS = 16


class JointThreshold(BlockStrategy):
    name = "joint_threshold"
    source = "SGLang JointThreshold (LLaDA2.1 token editing)"
    keys = ("edit_threshold", "max_post_edit_steps")
    code = JOINT
    default_threshold = DEFAULT_JOINT_THRESHOLD

    def check(self, p, *, family: Family, steps: int, block: int) -> None:
        if p.max_nfe is not None:
            raise InvalidRequestError(
                "max_nfe", "does not apply to joint_threshold (token editing)"
            )

    def resolved_fields(self, p) -> dict[str, Any]:
        return {
            "edit_threshold": (
                DEFAULT_EDIT_THRESHOLD if p.edit_threshold is None else p.edit_threshold
            ),
            "max_post_edit_steps": (
                DEFAULT_POST_EDIT_STEPS if p.max_post_edit_steps is None else p.max_post_edit_steps
            ),
        }

    def init_row(self, seq, *, eos_id: int | None, stop_ids: frozenset[int]) -> None:
        # a block stays editable until it ends: only the canvas before `final_upto` is final
        seq.editing = True


STRATEGIES = (JointThreshold(),)
