"""A request's diffusion settings: parsed, validated, and resolved against the model family.

`SamplingParams` is what a client asked for (unset values are `None`); `ResolvedParams` is what
the engine runs, with every default filled and every constraint checked. Each invalid value
raises one `InvalidRequestError` that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import InvalidRequestError

ALGORITHMS = (
    "low_confidence",
    "random",
    "origin",
    "maskgit_plus",
    "topk_margin",
    "entropy",
    "threshold",
)
STREAM_MODES = ("delta", "denoise")
CACHE_MODES = ("none", "prefix", "dual")
DEFAULT_THRESHOLD = 0.9
MAX_STOP_STRINGS = 16
MAX_BLOCK_DEFAULT = 32

# ---- numeric safety (issue 13) --------------------------------------------------------------
# Every accepted value must keep a step finite for every row. A positive temperature or
# alg_temp below MIN_POSITIVE_TEMPERATURE runs as that floor (dividing logits by 1e-300
# overflows to inf and NaN; at 1e-4 the draw is already the argmax); cfg_scale is capped
# because (scale + 1) * (cond - uncond) overflows half precision, and alg_temp like temperature
# (a float32 confidence divided by 1e300 is 0, and -inf / inf is NaN).
MIN_POSITIVE_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 100.0
MAX_CFG_SCALE = 100.0


def numerically_safe(value: float | None) -> float | None:
    """A positive temperature-like value raised to the floor; 0 and None unchanged."""
    if value is None or value <= 0:
        return value
    return max(value, MIN_POSITIVE_TEMPERATURE)


# ----------------------------------------------------------------------------------------------

ALIASES = {
    "gen_length": "max_tokens",
    "max_new_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "num_denoising_steps": "steps",
    "diffusion_steps": "steps",
    "remasking": "algorithm",
    "alg": "algorithm",
    "block_size": "block_length",
    "random_seed": "seed",
}


@dataclass
class SamplingParams:
    """Per-request settings as given; `None` means "use the default"."""

    max_tokens: int | None = None
    steps: int | None = None
    block_length: int | None = None
    algorithm: str | None = None
    threshold: float | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    alg_temp: float | None = None
    cfg_scale: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream_mode: str = "delta"
    suppress_eos: bool = False
    cache: str = "none"

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SamplingParams:
        """Parse JSON-like values (aliases accepted); unknown keys are an error, not ignored."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise InvalidRequestError("sampling_parameters", "must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = ALIASES.get(key, key)
            if name not in known:
                raise InvalidRequestError(key, "unknown parameter")
            if value is None:
                continue
            values[name] = _coerce(name, value)
        return cls(**values)


_INTS = {"max_tokens", "steps", "block_length", "top_k", "seed"}
_FLOATS = {"threshold", "temperature", "top_p", "alg_temp", "cfg_scale"}


def _coerce(name: str, value: Any) -> Any:
    if name in _INTS:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise InvalidRequestError(name, f"must be an integer, got {value!r}") from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequestError(name, f"must be an integer, got {value!r}")
        return value
    if name in _FLOATS:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise InvalidRequestError(name, f"must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(name, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise InvalidRequestError(name, "must be finite")
        return float(value)
    if name == "stop":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InvalidRequestError("stop", "must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in value):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        return list(value)
    if name == "suppress_eos":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise InvalidRequestError(name, f"must be a boolean, got {value!r}")
        return value
    if not isinstance(value, str):
        raise InvalidRequestError(name, f"must be a string, got {value!r}")
    return value


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
    max_tokens = default_max_tokens if p.max_tokens is None else p.max_tokens
    max_tokens = min(max_tokens, max_canvas) if p.max_tokens is None else max_tokens
    if max_tokens < 1:
        raise InvalidRequestError("max_tokens", "must be >= 1")
    if max_tokens > max_canvas:
        raise InvalidRequestError("max_tokens", f"must be <= {max_canvas} (server limit)")
    steps = max_tokens if p.steps is None else p.steps
    if steps < 1:
        raise InvalidRequestError("steps", "must be >= 1")
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
        if block < 1 or block > max_tokens:
            raise InvalidRequestError("block_length", f"must be in [1, max_tokens={max_tokens}]")
        if max_tokens % block:
            raise InvalidRequestError("block_length", f"must divide max_tokens ({max_tokens})")
    if steps % (max_tokens // block):
        raise InvalidRequestError(
            "steps", f"must be divisible by the number of blocks ({max_tokens // block})"
        )
    algorithm = p.algorithm or ("threshold" if p.threshold is not None else default_algorithm)
    if algorithm not in ALGORITHMS:
        raise InvalidRequestError("algorithm", f"must be one of {', '.join(ALGORITHMS)}")
    if algorithm == "origin" and family != "dream":
        raise InvalidRequestError(
            "algorithm", "origin is Dream's algorithm; use low_confidence or random"
        )
    threshold = p.threshold
    if algorithm == "threshold" and threshold is None:
        threshold = DEFAULT_THRESHOLD
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise InvalidRequestError("threshold", "must be in (0, 1]")
    if threshold is not None and algorithm in ("random", "origin", "entropy"):
        raise InvalidRequestError(
            "threshold", f"needs a confidence in [0, 1]; algorithm {algorithm} has none"
        )
    if not 0.0 <= p.temperature <= MAX_TEMPERATURE:
        raise InvalidRequestError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}]")
    if p.top_p is not None and not 0.0 < p.top_p <= 1.0:
        raise InvalidRequestError("top_p", "must be in (0, 1]")
    if p.top_k is not None and p.top_k < 0:
        raise InvalidRequestError("top_k", "must be >= 0 (0 disables)")
    if p.alg_temp is not None and not 0.0 <= p.alg_temp <= MAX_TEMPERATURE:
        raise InvalidRequestError("alg_temp", f"must be in [0, {MAX_TEMPERATURE:g}]")
    if not 0.0 <= p.cfg_scale <= MAX_CFG_SCALE:
        raise InvalidRequestError("cfg_scale", f"must be in [0, {MAX_CFG_SCALE:g}]")
    if p.cfg_scale > 0 and family != "llada":
        raise InvalidRequestError(
            "cfg_scale", "classifier-free guidance is supported for LLaDA only"
        )
    if p.seed is not None and not 0 <= p.seed < 2**63:
        raise InvalidRequestError("seed", "must be in [0, 2**63)")
    if p.stream_mode not in STREAM_MODES:
        raise InvalidRequestError("stream_mode", f"must be one of {', '.join(STREAM_MODES)}")
    if p.cache not in CACHE_MODES:
        raise InvalidRequestError("cache", f"must be one of {', '.join(CACHE_MODES)}")
    if p.cache != "none" and p.cfg_scale > 0:
        raise InvalidRequestError("cache", "cached mode cannot be combined with cfg_scale")
    return ResolvedParams(
        max_tokens=max_tokens,
        steps=steps,
        block_length=block,
        algorithm=algorithm,
        threshold=threshold,
        temperature=numerically_safe(p.temperature),
        top_p=p.top_p,
        top_k=p.top_k or None,
        alg_temp=numerically_safe(p.alg_temp) or None,
        cfg_scale=p.cfg_scale,
        seed=p.seed,
        stop=tuple(p.stop),
        stream_mode=p.stream_mode,
        suppress_eos=p.suppress_eos,
        cache=p.cache,
    )
