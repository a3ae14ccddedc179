"""What a decoding strategy is to the engine: one `Strategy` object per algorithm, defined in
its own file under `decoding/strategies/` and registered once (`strategies/__init__.py`).

A strategy owns the request keys only it takes and their checks and defaults
(`sampling_params.resolve` calls its hooks), the per-row state it keeps (`init_row`), the
host-side values it hands to the vectorised commit plan (`rule_code`, `confidence`), and
the row's place in a step: whether its keys live in a KV slot, refresh in a shared block
phase, or live in pages. The scheduler and the model runner ask the row's strategy
(`Sequence.strategy`) and never re-derive these from the settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import InvalidRequestError
from ..commit_rules import RANK, THRESHOLD
from ..proposals import PROBABILITY

if TYPE_CHECKING:
    from ...models import Family
    from ...sampling_params import ResolvedParams, SamplingParams
    from ...sequence import Sequence

# which models a strategy decodes (the docs table's "models" column)
CANVAS = "LLaDA, Dream"  # one canvas, optionally in semi-autoregressive blocks
BLOCK = "SDAR, LLaDA2"  # block-diffusion models: absolute blocks over an exact KV cache
UNIFORM = "DiffusionGemma"  # uniform-state diffusion over canvases


class Strategy:
    """One decoding strategy. Subclasses set the class attributes and override the hooks
    they need; the defaults are those of a step-scheduled confidence rule."""

    name: str = ""  # the request's `algorithm` value
    summary: str = ""  # what a step commits (docs)
    source: str = ""  # where it is published (docs)
    models: str = CANVAS
    keys: tuple[str, ...] = ()  # request keys only this strategy takes
    implied_by_keys: bool = False  # a request giving one of `keys` selects this strategy
    switch: str | None = None  # a boolean request key that selects this strategy
    selected_by_algorithm: bool = True  # a value of `algorithm` (else: `selection`)
    selection: str = ""  # how a request selects a strategy that is no `algorithm` (docs)
    threshold_doc: str = ""  # the docs' threshold default, where not `default_threshold`
    # ---- threshold ----
    threshold_kind: str = "confidence"  # "confidence" (in (0, 1]), "entropy" (nats), or "none"
    default_threshold: float | None = None  # applied when the request gives none
    # ---- commit plan (decoding/commit_rules.py) ----
    code: int = RANK  # the vectorised rule of this strategy's rows
    threshold_code: int | None = None  # the rule while the row commits by threshold instead
    confidence: str = PROBABILITY
    draws_positions: bool = False  # positions drawn at random each step (Dream's origin)
    needs_generator: bool = False  # draws random numbers even at temperature 0
    takes_alg_temp: bool = True
    # ---- canvas models ----
    family_specific: bool = False  # only families listing it in `Family.own_algorithms`
    decodes_in_blocks: bool = False  # blocks of 32 by default on every family (d3LLM)
    multi_block_rule: bool = False  # may drive d3LLM's multi-block decoding
    # ---- block-diffusion models ----
    step_schedule: bool = True  # `steps` applies (else refused)
    paged: bool = False  # keys live in pages of finished blocks (block_diffusion.py)

    # ---- resolving a request (sampling_params.resolve) ----
    def threshold_for(self, family: Family) -> float | None:
        """The threshold when the request gives none: the family's published value if any."""
        return family.default_thresholds.get(self.name, self.default_threshold)

    def family_refusal(self, family: Family) -> str:
        """The message when `family` does not publish this strategy."""
        return f"{self.name} is not published for {family.label}"

    def check(self, p: SamplingParams, *, family: Family, steps: int, block: int) -> None:
        """Rules of this strategy that need several keys or the model; raise on a bad one."""

    def resolved_fields(self, p: SamplingParams) -> dict[str, Any]:
        """This strategy's own settings for `ResolvedParams` (its keys' defaults applied)."""
        return {}

    def refuse_threshold(self, threshold: float | None) -> None:
        if threshold is not None and self.threshold_kind == "none":
            raise InvalidRequestError("threshold", f"algorithm {self.name} takes no threshold")

    # ---- a row (sequence.py) and its step ----
    def init_row(self, seq: Sequence, *, eos_id: int | None, stop_ids: frozenset[int]) -> None:
        """Set up the row's own state (the defaults: none)."""

    def rule_code(self, uses_threshold: bool) -> int:
        """The commit plan's rule for a row of this strategy this step."""
        if uses_threshold and self.threshold_code is not None:
            return self.threshold_code
        return self.code

    def slot_cached(self, params: ResolvedParams) -> bool:
        """The row's keys live in a KV slot of the pool (Fast-dLLM prefix / dual cache)."""
        return params.cache != "none"

    def phased(self, params: ResolvedParams) -> bool:
        """A cached row that refreshes at each block start, so the cached rows of a step share
        a block phase (scheduler.py)."""
        return self.slot_cached(params)

    def __repr__(self) -> str:
        return f"Strategy({self.name})"


class ConfidenceRule(Strategy):
    """LLaDA's and Dream's step-scheduled rules: the k most confident masked positions, or
    every position above `threshold` when the request gives one (Fast-dLLM's rule)."""

    threshold_code = THRESHOLD


class BlockStrategy(Strategy):
    """A rule of the block-diffusion models (SDAR, LLaDA2): absolute blocks, `steps` counted
    per block, keys of finished blocks in pages, never in a canvas slot."""

    models = BLOCK
    paged = True

    def canvas_refusal(self) -> str:
        """The message when a canvas model (LLaDA, Dream) is asked for this strategy."""
        return (
            f"{self.name} is a block-diffusion commit rule (SDAR, LLaDA2); "
            "this model takes low_confidence, threshold, entropy and the others in docs/api.md"
        )

    def slot_cached(self, params: ResolvedParams) -> bool:
        return False
