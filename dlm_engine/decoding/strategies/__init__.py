"""The decoding strategies, registered once: each file of this package defines its
strategies (`STRATEGIES`), and `STRATEGIES` here lists them in the order requests are
matched (a strategy whose keys imply it is tried in this order).

Adding a strategy: a file here with its `Strategy` subclass, one import below, its test, and
`python -m dlm_protocol.docgen` for docs/api.md's algorithms table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlm_protocol.params import ALGORITHM_SUMMARIES

from . import (
    entropy_threshold,
    factor,
    joint_threshold,
    local_leap,
    multi_bd,
    multi_block,
    published,
    sdar,
    threshold,
    uniform,
)
from .base import BLOCK, CANVAS, UNIFORM, BlockStrategy, Strategy
from .multi_block import MULTI_BLOCK
from .uniform import UNIFORM_STRATEGY

if TYPE_CHECKING:
    from ...sampling_params import ResolvedParams

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for module in (
        published,
        threshold,
        factor,  # before local_leap: `factor` given with LocalLeap's keys selects factor
        local_leap,
        entropy_threshold,
        multi_block,
        sdar,
        joint_threshold,
        multi_bd,
        uniform,
    )
    for s in module.STRATEGIES
}


def strategy_of(algorithm: str) -> Strategy:
    """The strategy a resolved `algorithm` names."""
    try:
        return STRATEGIES[algorithm]
    except KeyError:
        raise ValueError(f"unknown decoding strategy {algorithm!r}") from None


def row_strategy(params: ResolvedParams) -> Strategy:
    """The strategy that runs a row: multi-block decoding when asked for (its commit rule is
    the algorithm's), else the algorithm's own."""
    if params.accel.multi_block:
        return MULTI_BLOCK
    return strategy_of(params.algorithm)


def algorithms() -> list[Strategy]:
    """The strategies a request's `algorithm` can name."""
    return [s for s in STRATEGIES.values() if s.selected_by_algorithm]


def summary(s: Strategy) -> str:
    """What a step of `s` commits: the contract's line for an algorithm, else its own."""
    return ALGORITHM_SUMMARIES.get(s.name, s.summary)


def _threshold(s: Strategy) -> str:
    """The docs' threshold default of `s`: its own, and each family's published one."""
    from ...models import FAMILIES

    if s.threshold_doc:
        return s.threshold_doc
    if s.threshold_kind == "none":
        return "none"
    unit = " nats" if s.threshold_kind == "entropy" else ""
    if s.default_threshold is None:
        return f"optional{unit}"
    own = [
        f"{f.label} {f.default_thresholds[s.name]:g}"
        for f in FAMILIES
        if s.name in f.default_thresholds
    ]
    if own:
        return f"{', '.join(own)}{unit}"
    return f"{s.default_threshold:g}{unit}"


def algorithms_table() -> str:
    """docs/api.md's table of every registered strategy (generated: dlm_protocol.docgen)."""
    rows = [
        "| strategy | models | commits per step | threshold default | own keys | published in |",
        "|---|---|---|---|---|---|",
    ]
    for s in STRATEGIES.values():
        name = f"`{s.name}`" if s.selected_by_algorithm else f"`{s.name}`: {s.selection}"
        keys = ", ".join(f"`{k}`" for k in s.keys) or "—"
        models = s.models
        if s.family_specific:
            from ...models import FAMILIES

            models = ", ".join(f.label for f in FAMILIES if s.name in f.own_algorithms)
        rows.append(f"| {name} | {models} | {summary(s)} | {_threshold(s)} | {keys} | {s.source} |")
    return "\n".join(rows) + "\n"


__all__ = [
    "BLOCK",
    "CANVAS",
    "MULTI_BLOCK",
    "STRATEGIES",
    "UNIFORM",
    "UNIFORM_STRATEGY",
    "BlockStrategy",
    "Strategy",
    "algorithms",
    "algorithms_table",
    "row_strategy",
    "strategy_of",
    "summary",
]
