"""dlmserve's LocalLeap (dlmserve 0.1.1, arXiv 2510.07081): the schedule's k most confident
positions are anchors; anchors with confidence >= anchor_threshold also commit the masked
positions within leap_radius whose confidence >= neighbor_threshold. Published for LLaDA."""

from __future__ import annotations

from typing import Any

from ...errors import InvalidRequestError
from ...models import Family
from ..commit_rules import LEAP
from .base import ConfidenceRule

DEFAULT_ANCHOR_THRESHOLD = 0.9  # dlmserve SamplingParams: kappa
DEFAULT_NEIGHBOR_THRESHOLD = 0.75  # dlmserve SamplingParams: tau
DEFAULT_LEAP_RADIUS = 4  # dlmserve SamplingParams: W
MAX_LEAP_RADIUS = 16  # dlmserve's request range [1, 16]


def _unit(name: str, value: float | None) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise InvalidRequestError(name, "must be in [0, 1]")


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

    def check(self, p, *, family: Family, steps: int, block: int) -> None:
        _unit("anchor_threshold", p.anchor_threshold)
        _unit("neighbor_threshold", p.neighbor_threshold)
        if p.leap_radius is not None and not 1 <= p.leap_radius <= MAX_LEAP_RADIUS:
            raise InvalidRequestError("leap_radius", f"must be in [1, {MAX_LEAP_RADIUS}]")

    def resolved_fields(self, p) -> dict[str, Any]:
        def pick(value, default):
            return default if value is None else value

        return {
            "anchor_threshold": pick(p.anchor_threshold, DEFAULT_ANCHOR_THRESHOLD),
            "neighbor_threshold": pick(p.neighbor_threshold, DEFAULT_NEIGHBOR_THRESHOLD),
            "leap_radius": pick(p.leap_radius, DEFAULT_LEAP_RADIUS),
        }


STRATEGIES = (LocalLeap(),)
