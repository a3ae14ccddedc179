"""A request's diffusion settings: parsed, validated, and resolved against the model family.

`SamplingParams` is what a client asked for, checked key by key against the request contract
(`dlm_protocol.params`: types, ranges, aliases); `ResolvedParams` is what the engine runs, with
every default filled and the rules that need the model or several keys checked here, in the
one place that knows the model. Each invalid value raises one `InvalidRequestError` naming the
field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlm_protocol import PARAMS, parse_params
from dlm_protocol.params import (
    ALGORITHMS,
    CACHE_MODES,
    DEFAULT_THRESHOLD,
    MAX_STOP_STRINGS,
    STREAM_MODES,
)

from .errors import InvalidRequestError

__all__ = [
    "ALGORITHMS",
    "CACHE_MODES",
    "DEFAULT_THRESHOLD",
    "MAX_STOP_STRINGS",
    "STREAM_MODES",
    "ResolvedParams",
    "SamplingParams",
    "resolve",
]
MAX_BLOCK_DEFAULT = 32


class SamplingParams:
    """Per-request settings as given; a key left out reads as its contract default.

    Its keys are exactly `dlm_protocol.PARAMS` (a key added there is accepted here); values
    are type- and range-checked on construction, aliases accepted, unknown keys refused.
    """

    def __init__(self, /, **values: Any) -> None:  # `self` positional-only: any key is data
        given = parse_params(values)
        for p in PARAMS:
            default = list(p.default) if isinstance(p.default, tuple) else p.default
            setattr(self, p.name, given.get(p.name, default))
        self.given = frozenset(given)  # keys the client set (for logs and tests)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Parse JSON-like values (aliases accepted); unknown keys are an error, not ignored."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise InvalidRequestError("sampling_parameters", "must be a JSON object")
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return {p.name: getattr(self, p.name) for p in PARAMS}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingParams) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k in self.given)
        return f"SamplingParams({items})"


@dataclass(frozen=True)
class ResolvedParams:
    """Everything the engine needs to run one request; all defaults applied."""

    max_tokens: int
    steps: int
    block_length: int
    algorithm: str
    threshold: float | None
    temperature: float
    top_p: float | None
    top_k: int | None
    alg_temp: float | None
    cfg_scale: float
    seed: int | None
    stop: tuple[str, ...]
    stream_mode: str
    suppress_eos: bool
    cache: str
    max_nfe: int | None = None

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks


def default_block_length(max_tokens: int, steps: int) -> int | None:
    """Largest block ≤ 32 dividing the canvas whose block count also divides `steps`."""
    for b in range(min(MAX_BLOCK_DEFAULT, max_tokens), 0, -1):
        if max_tokens % b == 0 and steps % (max_tokens // b) == 0:
            return b
    return None


def resolve(
    p: SamplingParams,
    *,
    family: str,
    default_algorithm: str,
    uses_blocks: bool,
    max_canvas: int,
    default_max_tokens: int,
) -> ResolvedParams:
    """Check `p` against the family and limits, fill defaults; raise on the first bad field."""
    max_tokens = min(default_max_tokens, max_canvas) if p.max_tokens is None else p.max_tokens
    if max_tokens > max_canvas:
        raise InvalidRequestError("max_tokens", f"must be <= {max_canvas} (server limit)")
    steps = max_tokens if p.steps is None else p.steps
    if steps > max_tokens:
        raise InvalidRequestError("steps", f"must be <= max_tokens ({max_tokens})")
    if p.block_length is None:
        block = default_block_length(max_tokens, steps) if uses_blocks else max_tokens
        if block is None:
            raise InvalidRequestError(
                "steps",
                f"no block length divides max_tokens={max_tokens} into a count dividing steps={steps}",
            )
    else:
        block = p.block_length
        if block > max_tokens:
            raise InvalidRequestError("block_length", f"must be in [1, max_tokens={max_tokens}]")
        if max_tokens % block:
            raise InvalidRequestError("block_length", f"must divide max_tokens ({max_tokens})")
    if steps % (max_tokens // block):
        raise InvalidRequestError(
            "steps", f"must be divisible by the number of blocks ({max_tokens // block})"
        )
    algorithm = p.algorithm or ("threshold" if p.threshold is not None else default_algorithm)
    if algorithm == "origin" and family != "dream":
        raise InvalidRequestError(
            "algorithm", "origin is Dream's algorithm; use low_confidence or random"
        )
    threshold = p.threshold
    if algorithm == "threshold" and threshold is None:
        threshold = DEFAULT_THRESHOLD
    if threshold is not None and algorithm in ("random", "origin", "entropy"):
        raise InvalidRequestError(
            "threshold", f"needs a confidence in [0, 1]; algorithm {algorithm} has none"
        )
    if p.cfg_scale > 0 and family != "llada":
        raise InvalidRequestError(
            "cfg_scale", "classifier-free guidance is supported for LLaDA only"
        )
    if p.cache != "none" and p.cfg_scale > 0:
        raise InvalidRequestError("cache", "cached mode cannot be combined with cfg_scale")
    return ResolvedParams(
        max_tokens=max_tokens,
        steps=steps,
        block_length=block,
        algorithm=algorithm,
        threshold=threshold,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        alg_temp=p.alg_temp or None,
        cfg_scale=p.cfg_scale,
        seed=p.seed,
        stop=tuple(p.stop),
        stream_mode=p.stream_mode,
        suppress_eos=p.suppress_eos,
        cache=p.cache,
        max_nfe=p.max_nfe,
    )
