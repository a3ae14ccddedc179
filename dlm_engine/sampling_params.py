"""A request's diffusion settings: parsed, validated, and resolved against the model family.

`SamplingParams` is what a client asked for (unset values are `None`); `ResolvedParams` is what
the engine runs, with every default filled and every constraint checked. Each invalid value
raises one `InvalidRequestError` that names the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import InvalidRequestError

# ---- issue 15: accelerated decoding (LocalLeap, d3LLM multi-block / entropy threshold,
# Fast-dLLM factor). Their keys, defaults and checks are the marked block at the bottom. ----
ACCELERATED_ALGORITHMS = ("local_leap", "entropy_threshold", "factor")

ALGORITHMS = (
    "low_confidence",
    "random",
    "origin",
    "maskgit_plus",
    "topk_margin",
    "entropy",
    "threshold",
    *ACCELERATED_ALGORITHMS,
)
STREAM_MODES = ("delta", "denoise")
CACHE_MODES = ("none", "prefix", "dual")
DEFAULT_THRESHOLD = 0.9
MAX_STOP_STRINGS = 16
MAX_BLOCK_DEFAULT = 32

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
    # dlmserve's LocalLeap request fields (issue 15)
    "local_leap_anchor_threshold": "anchor_threshold",
    "local_leap_neighbor_threshold": "neighbor_threshold",
    "local_leap_radius": "leap_radius",
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
    # issue 15 (see the marked block at the bottom); None = not given
    factor: float | None = None
    anchor_threshold: float | None = None
    neighbor_threshold: float | None = None
    leap_radius: int | None = None
    multi_block: bool | None = None
    block_add_threshold: float | None = None
    decoded_token_threshold: float | None = None
    max_active_blocks: int | None = None
    use_local_leap: bool | None = None
    force_single_batch: bool | None = None

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


_INTS = {"max_tokens", "steps", "block_length", "top_k", "seed", "leap_radius", "max_active_blocks"}
_FLOATS = {
    "threshold",
    "temperature",
    "top_p",
    "alg_temp",
    "cfg_scale",
    "factor",
    "anchor_threshold",
    "neighbor_threshold",
    "block_add_threshold",
    "decoded_token_threshold",
}
_BOOLS = {"suppress_eos", "multi_block", "use_local_leap", "force_single_batch"}


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
    if name in _BOOLS:
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
    accel: Acceleration = field(default_factory=lambda: Acceleration())

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
    model_defaults: dict[str, Any] | None = None,
) -> ResolvedParams:
    """Check `p` against the family and limits, fill defaults; raise on the first bad field.

    `model_defaults` are the checkpoint's own decoding defaults (e.g. d3LLM's multi-block
    settings), applied to keys the request left unset."""
    p = apply_model_defaults(p, model_defaults)
    uses_blocks = uses_blocks or wants_blocks(p)
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
    algorithm = pick_algorithm(p) or ("threshold" if p.threshold is not None else default_algorithm)
    if algorithm not in ALGORITHMS:
        raise InvalidRequestError("algorithm", f"must be one of {', '.join(ALGORITHMS)}")
    if algorithm == "origin" and family != "dream":
        raise InvalidRequestError(
            "algorithm", "origin is Dream's algorithm; use low_confidence or random"
        )
    threshold = p.threshold
    if algorithm == "threshold" and threshold is None:
        threshold = DEFAULT_THRESHOLD
    if algorithm == "entropy_threshold" and threshold is None:
        threshold = DEFAULT_ENTROPY_THRESHOLD
    if algorithm == "entropy_threshold":
        if not 0.0 < threshold <= MAX_ENTROPY_THRESHOLD:
            raise InvalidRequestError(
                "threshold",
                f"entropy_threshold bounds the entropy in nats: must be in "
                f"(0, {MAX_ENTROPY_THRESHOLD}]",
            )
    elif threshold is not None and not 0.0 < threshold <= 1.0:
        raise InvalidRequestError("threshold", "must be in (0, 1]")
    if threshold is not None and algorithm in ("random", "origin", "entropy"):
        raise InvalidRequestError(
            "threshold", f"needs a confidence in [0, 1]; algorithm {algorithm} has none"
        )
    if not 0.0 <= p.temperature <= 100.0:
        raise InvalidRequestError("temperature", "must be in [0, 100]")
    if p.top_p is not None and not 0.0 < p.top_p <= 1.0:
        raise InvalidRequestError("top_p", "must be in (0, 1]")
    if p.top_k is not None and p.top_k < 0:
        raise InvalidRequestError("top_k", "must be >= 0 (0 disables)")
    if p.alg_temp is not None and p.alg_temp < 0:
        raise InvalidRequestError("alg_temp", "must be >= 0")
    if p.cfg_scale < 0:
        raise InvalidRequestError("cfg_scale", "must be >= 0")
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
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k or None,
        alg_temp=p.alg_temp or None,
        cfg_scale=p.cfg_scale,
        seed=p.seed,
        stop=tuple(p.stop),
        stream_mode=p.stream_mode,
        suppress_eos=p.suppress_eos,
        cache=p.cache,
        accel=resolve_acceleration(p, family=family, algorithm=algorithm, threshold=threshold),
    )


# ==== issue 15: accelerated decoding — LocalLeap (dlmserve 0.1.1, arXiv 2510.07081), d3LLM
# multi-block decoding and entropy threshold (hao-ai-lab/d3LLM, SGLang PR #20615), Fast-dLLM's
# factor rule (NVlabs/Fast-dLLM llada/generate.py). Published defaults below. ====

DEFAULT_ENTROPY_THRESHOLD = 0.5  # d3LLM generate()/diffusion_generate(threshold=0.5)
MAX_ENTROPY_THRESHOLD = 20.0  # nats; ln(vocab) of any real tokenizer is below this
DEFAULT_FACTOR = 1.0  # Fast-dLLM get_transfer_index_dynamic(factor=1)
DEFAULT_ANCHOR_THRESHOLD = 0.9  # dlmserve SamplingParams: kappa
DEFAULT_NEIGHBOR_THRESHOLD = 0.75  # dlmserve SamplingParams: tau
DEFAULT_LEAP_RADIUS = 4  # dlmserve SamplingParams: W
MAX_LEAP_RADIUS = 16  # dlmserve's request range [1, 16]
DEFAULT_BLOCK_ADD_THRESHOLD = 0.1  # d3LLM eval scripts and SGLang FullAttnMultiBlock
DEFAULT_DECODED_TOKEN_THRESHOLD = 0.95  # idem
MULTI_BLOCK_RULES = ("entropy_threshold", "threshold", "factor")
LLADA_ONLY = {"local_leap": "dlmserve", "factor": "Fast-dLLM"}

# keys that choose the decoding rule: a request naming any of them gets none of the model's
# rule defaults (a d3LLM checkpoint's multi-block settings never mix into a request's own rule)
_RULE_KEYS = (
    "algorithm",
    "threshold",
    "factor",
    "use_local_leap",
    "multi_block",
    "anchor_threshold",
    "neighbor_threshold",
    "leap_radius",
)


@dataclass(frozen=True)
class Acceleration:
    """The resolved settings of the accelerated rules (unused fields stay at their defaults)."""

    factor: float = DEFAULT_FACTOR
    anchor_threshold: float = DEFAULT_ANCHOR_THRESHOLD
    neighbor_threshold: float = DEFAULT_NEIGHBOR_THRESHOLD
    leap_radius: int = DEFAULT_LEAP_RADIUS
    multi_block: bool = False
    block_add_threshold: float = DEFAULT_BLOCK_ADD_THRESHOLD
    decoded_token_threshold: float = DEFAULT_DECODED_TOKEN_THRESHOLD
    max_active_blocks: int | None = None  # None: as many as the thresholds add (d3LLM)


def apply_model_defaults(p: SamplingParams, defaults: dict[str, Any] | None) -> SamplingParams:
    """The checkpoint's decoding defaults for keys the request did not set."""
    if not defaults:
        return p
    rule_given = any(getattr(p, k) is not None for k in _RULE_KEYS)
    fill = {
        k: v
        for k, v in defaults.items()
        if getattr(p, k, None) is None and not (rule_given and k in _RULE_KEYS + _MB_KEYS)
    }
    return replace(p, **fill) if fill else p


_MB_KEYS = ("block_add_threshold", "decoded_token_threshold", "max_active_blocks")


def wants_blocks(p: SamplingParams) -> bool:
    """Multi-block and d3LLM's entropy threshold decode in blocks (32 by default) on every
    family, as published; Dream otherwise uses the whole canvas."""
    return bool(p.multi_block) or p.algorithm == "entropy_threshold"


def pick_algorithm(p: SamplingParams) -> str | None:
    """The algorithm named by the request, including the seeds' switches."""
    if p.use_local_leap:
        if p.algorithm not in (None, "local_leap"):
            raise InvalidRequestError(
                "use_local_leap", f"selects local_leap; it conflicts with algorithm={p.algorithm}"
            )
        return "local_leap"
    if p.algorithm:
        return p.algorithm
    if p.factor is not None:
        return "factor"
    if p.multi_block:  # d3LLM's rule; its `threshold` is the entropy bound
        return "entropy_threshold"
    return None


def _unit(name: str, value: float | None, *, zero_ok: bool = False) -> None:
    if value is None:
        return
    ok = (0.0 <= value <= 1.0) if zero_ok else (0.0 < value <= 1.0)
    if not ok:
        raise InvalidRequestError(name, f"must be in {'[0' if zero_ok else '(0'}, 1]")


def resolve_acceleration(
    p: SamplingParams, *, family: str, algorithm: str, threshold: float | None
) -> Acceleration:
    """Check the accelerated rules' keys and fill their published defaults."""
    if algorithm in LLADA_ONLY and family != "llada":
        raise InvalidRequestError(
            "algorithm", f"{algorithm} is published for LLaDA ({LLADA_ONLY[algorithm]}) only"
        )
    leap_keys = ("anchor_threshold", "neighbor_threshold", "leap_radius")
    if algorithm != "local_leap":
        for key in leap_keys:
            if getattr(p, key) is not None:
                raise InvalidRequestError(key, "applies to algorithm local_leap only")
    if p.factor is not None and algorithm != "factor":
        raise InvalidRequestError("factor", "applies to algorithm factor only")
    if algorithm in ("factor", "local_leap") and threshold is not None:
        raise InvalidRequestError("threshold", f"algorithm {algorithm} takes no threshold")
    if p.factor is not None and not 0.0 < p.factor <= 100.0:
        raise InvalidRequestError("factor", "must be in (0, 100]")
    _unit("anchor_threshold", p.anchor_threshold, zero_ok=True)
    _unit("neighbor_threshold", p.neighbor_threshold, zero_ok=True)
    if p.leap_radius is not None and not 1 <= p.leap_radius <= MAX_LEAP_RADIUS:
        raise InvalidRequestError("leap_radius", f"must be in [1, {MAX_LEAP_RADIUS}]")
    multi = bool(p.multi_block)
    if not multi:
        for key in _MB_KEYS:
            if getattr(p, key) is not None:
                raise InvalidRequestError(key, "applies to multi_block decoding only")
    else:
        if algorithm not in MULTI_BLOCK_RULES:
            raise InvalidRequestError(
                "algorithm",
                f"multi_block needs a commit rule without a step schedule: "
                f"{', '.join(MULTI_BLOCK_RULES)}",
            )
        if p.cache != "none":
            raise InvalidRequestError(
                "cache", "multi_block runs d3LLM's no-cache loop; use cache none"
            )
        if p.cfg_scale > 0:
            raise InvalidRequestError("multi_block", "cannot be combined with cfg_scale")
        _unit("block_add_threshold", p.block_add_threshold, zero_ok=True)
        _unit("decoded_token_threshold", p.decoded_token_threshold)
        if p.max_active_blocks is not None and p.max_active_blocks < 1:
            raise InvalidRequestError("max_active_blocks", "must be >= 1")
    if algorithm in ACCELERATED_ALGORITHMS and p.alg_temp:
        raise InvalidRequestError("alg_temp", f"does not apply to algorithm {algorithm}")

    def pick(value, default):
        return default if value is None else value

    return Acceleration(
        factor=pick(p.factor, DEFAULT_FACTOR),
        anchor_threshold=pick(p.anchor_threshold, DEFAULT_ANCHOR_THRESHOLD),
        neighbor_threshold=pick(p.neighbor_threshold, DEFAULT_NEIGHBOR_THRESHOLD),
        leap_radius=pick(p.leap_radius, DEFAULT_LEAP_RADIUS),
        multi_block=multi,
        block_add_threshold=pick(p.block_add_threshold, DEFAULT_BLOCK_ADD_THRESHOLD),
        decoded_token_threshold=pick(p.decoded_token_threshold, DEFAULT_DECODED_TOKEN_THRESHOLD),
        max_active_blocks=p.max_active_blocks,
    )
