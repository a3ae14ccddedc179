"""dlmserve's LocalLeap (dlmserve 0.1.1, arXiv 2510.07081): the schedule's k most confident
positions are anchors; anchors with confidence >= anchor_threshold also commit the masked
positions within leap_radius whose confidence >= neighbor_threshold. Published for LLaDA."""

from __future__ import annotations

from typing import Any

from ...models import Family
from ..commit_rules import LEAP
from .base import ConfidenceRule

DEFAULT_ANCHOR_THRESHOLD = 0.9  # dlmserve SamplingParams: kappa
DEFAULT_NEIGHBOR_THRESHOLD = 0.75  # dlmserve SamplingParams: tau
DEFAULT_LEAP_RADIUS = 4  # dlmserve SamplingParams: W


class LocalLeap(ConfidenceRule):
    name = "local_leap"
    source = "dlmserve 0.1.1 (LocalLeap, arXiv 2510.07081)"
    keys = ("anchor_threshold", "neighbor_threshold", "leap_radius")
    implied_by_keys = True
    switch = "use_local_leap"  # the seeds' boolean that selects it
    threshold_kind = "none"
    code = LEAP
    threshold_code = None
    takes_alg_temp = False
    family_specific = True

    def family_refusal(self, family: Family) -> str:
        return "local_leap is published for LLaDA (dlmserve) only"

    def resolved_fields(self, p) -> dict[str, Any]:
        def pick(value, default):
            return default if value is None else value

        return {
            "anchor_threshold": pick(p.anchor_threshold, DEFAULT_ANCHOR_THRESHOLD),
            "neighbor_threshold": pick(p.neighbor_threshold, DEFAULT_NEIGHBOR_THRESHOLD),
            "leap_radius": pick(p.leap_radius, DEFAULT_LEAP_RADIUS),
        }


STRATEGIES = (LocalLeap(),)
