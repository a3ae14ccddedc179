"""A request's diffusion settings: parsed, validated, and resolved against the model family.

`SamplingParams` is what a client asked for, checked key by key against the request contract
(`dlm_protocol.params`: types, ranges, aliases); `ResolvedParams` is what the engine runs, with
every default filled and the rules that need the model or several keys checked here, in the
one place that knows the model. Each invalid value raises one `InvalidRequestError` naming the
field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dlm_protocol import PARAMS, parse_params
from dlm_protocol.logit_bias import token_biases
from dlm_protocol.params import (
    ALGORITHMS,
    BLOCK_ALGORITHM_KEYS,
    BLOCK_ALGORITHMS,
    CACHE_MODES,
    DEFAULT_ADD_BLOCK_THRESHOLD,
    DEFAULT_BUFFER_SIZE,
    DEFAULT_SEMI_COMPLETE_THRESHOLD,
    DEFAULT_THRESHOLD,
    MAX_ENTROPY_THRESHOLD,
    MAX_STOP_STRINGS,
    MIN_POSITIVE_TEMPERATURE,
    STREAM_MODES,
)

from .decoding.grammar import CONSTRAINT_KEYS, Constraint, parse_constraint
from .decoding.grammar import coerce_value as coerce_constraint
from .errors import InvalidRequestError
from .scoring import DEFAULT_MC_SAMPLES
from .tools import ToolSpec, resolve_tools, tool_constraint

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


def numerically_safe(value: float | None) -> float | None:
    """A positive temperature-like value raised to the contract's floor; 0 and None unchanged."""
    if value is None or value <= 0:
        return value
    return max(value, MIN_POSITIVE_TEMPERATURE)


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
    accel: Acceleration = field(default_factory=lambda: Acceleration())
    constraint: Constraint | None = None  # structure constraint (decoding/grammar.py)
    logprobs: int | None = None  # record committed tokens' logprobs, with N alternatives
    tools: ToolSpec | None = None  # tool calling (tools.py); None also for `none`
    score: int | None = None  # score the prompt with this many MC samples (scoring.py)
    priority: int = 0  # admission order, lower first (scheduler.py)
    uniform: Any = None  # DiffusionGemma's UniformSettings (decoding/uniform_diffusion.py)
    # mixed into the first prompt page's hash: only requests with the same salt share
    # cached prompt pages (prefix_cache.py); None = the unsalted chain
    cache_salt: str | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the window logits each step
    # (decoding/logit_bias.py); None = no bias
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # a block-diffusion model's request: blocks aligned to absolute positions,
    # `steps` counted per block (block_diffusion.py)
    block_diffusion: bool = False
    edit_threshold: float = 0.0  # LLaDA2.1 token editing (joint_threshold)
    max_post_edit_steps: int = 16
    # Diffulex multi-block diffusion (multi_bd): the running set's size and rules
    buffer_size: int = DEFAULT_BUFFER_SIZE
    add_block_threshold: float = DEFAULT_ADD_BLOCK_THRESHOLD
    semi_complete_threshold: float = DEFAULT_SEMI_COMPLETE_THRESHOLD

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length

    @property
    def steps_per_block(self) -> int:
        if self.block_diffusion:
            return self.steps
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
    model_block: int = 0,
) -> ResolvedParams:
    """Check `p` against the family and limits, fill defaults; raise on the first bad field.

    `model_defaults` are the checkpoint's own decoding defaults (e.g. d3LLM's multi-block
    settings), applied to keys the request left unset. `model_block` > 0 marks a
    block-diffusion model (SDAR, LLaDA2) and is its trained block length."""
    from .decoding.uniform_params import refuse_uniform_keys, resolve_uniform

    if family == "diffusion_gemma":  # uniform-state diffusion: its own sampler settings
        return resolve_uniform(p, model_defaults or {}, max_canvas, default_max_tokens)
    refuse_uniform_keys(p)
    p = apply_model_defaults(p, model_defaults)
    if not model_block:
        for algorithm, keys in BLOCK_ALGORITHM_KEYS.items():
            for key in keys:
                if getattr(p, key) is not None:
                    raise InvalidRequestError(
                        key, f"applies to block-diffusion models (SDAR, LLaDA2; {algorithm})"
                    )
        if p.algorithm == "multi_bd":
            raise InvalidRequestError(
                "algorithm", "multi_bd (Diffulex) is for block-diffusion models (SDAR, LLaDA2)"
            )
        if p.algorithm in BLOCK_ALGORITHMS:  # proven against SDAR/LLaDA2 loops only
            raise InvalidRequestError(
                "algorithm",
                f"{p.algorithm} is a block-diffusion commit rule (SDAR, LLaDA2); "
                "this model takes low_confidence, threshold, entropy and the others in docs/api.md",
            )
    if model_block:
        return resolve_block_diffusion(
            p,
            family=family,
            model_block=model_block,
            max_canvas=max_canvas,
            default_max_tokens=default_max_tokens,
        )
    uses_blocks = uses_blocks or wants_blocks(p)
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
    algorithm = pick_algorithm(p) or ("threshold" if p.threshold is not None else default_algorithm)
    if algorithm == "origin" and family != "dream":
        raise InvalidRequestError(
            "algorithm", "origin is Dream's algorithm; use low_confidence or random"
        )
    threshold = p.threshold
    if algorithm == "threshold" and threshold is None:
        threshold = DEFAULT_THRESHOLD
    if algorithm == "entropy_threshold" and threshold is None:
        threshold = DEFAULT_ENTROPY_THRESHOLD
    if algorithm != "entropy_threshold" and threshold is not None and threshold > 1.0:
        raise InvalidRequestError(
            "threshold",
            f"must be in (0, 1] for a confidence rule (up to {MAX_ENTROPY_THRESHOLD:g} nats "
            "only with entropy_threshold)",
        )
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
        alg_temp=numerically_safe(p.alg_temp) or None,
        cfg_scale=p.cfg_scale,
        cache=resolve_cache(p),
        **_shared_fields(p),  # tools and structure checked before the accelerations, as before
        accel=resolve_acceleration(p, family=family, algorithm=algorithm, threshold=threshold),
    )


def _shared_fields(p: SamplingParams) -> dict[str, Any]:
    """The resolved keys every family treats alike: sampling, stops, streaming, structure,
    logprobs, tools, scoring, priority."""
    tools = resolve_tools(p.tools, p.tool_choice, p.parallel_tool_calls)
    constraint = _constraint(p, tools)
    return {
        "temperature": numerically_safe(p.temperature),
        "top_p": p.top_p,
        "top_k": p.top_k,
        "seed": p.seed,
        "stop": tuple(p.stop),
        "stream_mode": p.stream_mode,
        "suppress_eos": p.suppress_eos,
        "max_nfe": p.max_nfe,
        "constraint": constraint,
        "logprobs": p.logprobs,
        "tools": tools,
        "score": _score(p, constraint),
        "priority": p.priority,
        "cache_salt": p.cache_salt,
        "logit_bias": tuple(sorted(token_biases(p.logit_bias).items())) or None,
    }


def _score(p: SamplingParams, constraint: Constraint | None) -> int | None:
    """Monte-Carlo samples of a scoring request (`score: true`), None when generating."""
    if not p.score:
        return None
    if token_biases(p.logit_bias):
        raise InvalidRequestError("logit_bias", "does not apply to scoring (score)")
    if constraint is not None:
        raise InvalidRequestError("score", f"scores a text; {constraint.field} does not apply")
    return p.mc_samples or DEFAULT_MC_SAMPLES


def _constraint(p: SamplingParams, tools: ToolSpec | None) -> Constraint | None:
    """The request's structure constraint, or the tool-call grammar of `tool_choice`
    `required` / a named function; not both."""
    constraint = parse_constraint({k: coerce_constraint(k, getattr(p, k)) for k in CONSTRAINT_KEYS})
    if tools is None or not tools.constrained:
        return constraint
    if constraint is not None:
        raise InvalidRequestError(
            "tool_choice", f"{tools.choice} cannot be combined with {constraint.field}"
        )
    return tool_constraint(tools)


# ==== accelerated decoding — LocalLeap (dlmserve 0.1.1, arXiv 2510.07081), d3LLM
# multi-block decoding and entropy threshold (hao-ai-lab/d3LLM, SGLang PR #20615), Fast-dLLM's
# factor rule (NVlabs/Fast-dLLM llada/generate.py). Published defaults below. ====

ACCELERATED_ALGORITHMS = ("local_leap", "entropy_threshold", "factor")
DEFAULT_ENTROPY_THRESHOLD = 0.5  # d3LLM generate()/diffusion_generate(threshold=0.5)
DEFAULT_FACTOR = 1.0  # Fast-dLLM get_transfer_index_dynamic(factor=1)
DEFAULT_ANCHOR_THRESHOLD = 0.9  # dlmserve SamplingParams: kappa
DEFAULT_NEIGHBOR_THRESHOLD = 0.75  # dlmserve SamplingParams: tau
DEFAULT_LEAP_RADIUS = 4  # dlmserve SamplingParams: W
MAX_LEAP_RADIUS = 16  # dlmserve's request range [1, 16]
DEFAULT_BLOCK_ADD_THRESHOLD = 0.1  # d3LLM eval scripts and SGLang FullAttnMultiBlock
DEFAULT_DECODED_TOKEN_THRESHOLD = 0.95  # idem
# d3LLM's delayed KV cache (multi_block with cache prefix): d3LLM-LLaDA's published chat
# setting (chat/chat_d3llm_llada.py: cache_delay_iter=2; its Dream coder eval uses 32);
# refresh_interval upstream defaults to 10000, i.e. never (None here)
DEFAULT_CACHE_DELAY_ITER = 2
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
    cache_delay_iter: int = DEFAULT_CACHE_DELAY_ITER  # multi_block with cache prefix only
    refresh_interval: int | None = None  # None: never
    early_stop: bool = False  # d3LLM's early_stop: end-of-text fills the canvas after it


def apply_model_defaults(p: SamplingParams, defaults: dict[str, Any] | None) -> SamplingParams:
    """The checkpoint's decoding defaults for keys the request did not set."""
    if not defaults:
        return p
    rule_given = any(getattr(p, k) is not None for k in _RULE_KEYS)
    # d3LLM's early stop is published for its no-cache loop (see resolve_acceleration)
    skip = ("early_stop",) if resolve_cache(p) == "prefix" else ()
    fill = {
        k: v
        for k, v in defaults.items()
        if getattr(p, k, None) is None
        and not (rule_given and k in _RULE_KEYS + _MB_KEYS + ("early_stop",))
        and k not in skip
    }
    if not fill:
        return p
    return SamplingParams(**{k: getattr(p, k) for k in p.given}, **fill)


_MB_KEYS = ("block_add_threshold", "decoded_token_threshold", "max_active_blocks")
# d3LLM's delayed KV cache: they imply multi_block, and cache prefix unless `cache` is given
_MB_CACHE_KEYS = ("cache_delay_iter", "refresh_interval")


def wants_blocks(p: SamplingParams) -> bool:
    """Multi-block and d3LLM's entropy threshold decode in blocks (32 by default) on every
    family, as published; Dream otherwise uses the whole canvas."""
    return wants_multi_block(p) or p.algorithm == "entropy_threshold"


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
    if any(getattr(p, k) is not None for k in _LEAP_KEYS):  # LocalLeap's own keys imply it
        return "local_leap"
    if wants_multi_block(p):  # d3LLM's rule; its `threshold` is the entropy bound
        return "entropy_threshold"
    return None


_LEAP_KEYS = ("anchor_threshold", "neighbor_threshold", "leap_radius")


def wants_multi_block(p: SamplingParams) -> bool:
    """`multi_block: true`, or one of its own keys given without `multi_block: false`."""
    if p.multi_block is not None:
        return bool(p.multi_block)
    return bool(p.early_stop) or any(getattr(p, k) is not None for k in _MB_KEYS + _MB_CACHE_KEYS)


def resolve_cache(p: SamplingParams) -> str:
    """The request's cache mode: as given; a delayed-cache key without `cache` means prefix."""
    if "cache" not in p.given and any(getattr(p, k) is not None for k in _MB_CACHE_KEYS):
        return "prefix"
    return p.cache


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
    if algorithm != "local_leap":
        for key in _LEAP_KEYS:
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
    multi = wants_multi_block(p)
    cache = resolve_cache(p)
    if not multi:
        for key in (*_MB_KEYS, *_MB_CACHE_KEYS, "early_stop"):
            if getattr(p, key) not in (None, False):
                raise InvalidRequestError(key, "applies to multi_block decoding only (not false)")
    else:
        if algorithm not in MULTI_BLOCK_RULES:
            raise InvalidRequestError(
                "algorithm",
                f"multi_block needs a commit rule without a step schedule: "
                f"{', '.join(MULTI_BLOCK_RULES)}",
            )
        if cache == "dual":
            raise InvalidRequestError(
                "cache",
                "multi_block has d3LLM's delayed prefix cache only (cache prefix) or none; "
                "d3LLM publishes no dual-cache variant",
            )
        if cache != "prefix":
            for key in _MB_CACHE_KEYS:
                if getattr(p, key) is not None:
                    raise InvalidRequestError(key, "applies to multi_block with cache prefix only")
        if p.cfg_scale > 0:
            raise InvalidRequestError("multi_block", "cannot be combined with cfg_scale")
        _unit("block_add_threshold", p.block_add_threshold, zero_ok=True)
        _unit("decoded_token_threshold", p.decoded_token_threshold)
        if p.max_active_blocks is not None and p.max_active_blocks < 1:
            raise InvalidRequestError("max_active_blocks", "must be >= 1")
        if p.early_stop and cache == "prefix":
            raise InvalidRequestError(
                "early_stop", "not with d3LLM's delayed cache (cache: prefix); send false"
            )
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
        cache_delay_iter=pick(p.cache_delay_iter, DEFAULT_CACHE_DELAY_ITER),
        refresh_interval=p.refresh_interval,
        early_stop=bool(p.early_stop),
    )


# ==== block-diffusion models (SDAR generate.py `block_diffusion_generate`, LLaDA2
# `generate`). Published defaults: SDAR confidence_threshold 0.85 and eb_threshold 0.35,
# LLaDA2 threshold 0.95. ====

BLOCK_CONFIDENCE_DEFAULTS = {"sdar": 0.85, "llada2": 0.95}
# Diffulex multi_bd: its SDAR sampler compares with a fixed 0.95 (diffulex/sampler/sdar.py),
# its LLaDA2 sampler with accept_threshold, 0.9 by default (diffulex/config.py)
MULTI_BD_THRESHOLDS = {"sdar": 0.95, "llada2": 0.9}
DEFAULT_EB_THRESHOLD = 0.35
# SGLang JointThreshold (LLaDA2.1 token editing): threshold 0.5, edit_threshold 0.0,
# max_post_edit_steps 16
DEFAULT_JOINT_THRESHOLD = 0.5
DEFAULT_EDIT_THRESHOLD = 0.0
DEFAULT_POST_EDIT_STEPS = 16
_NOT_FOR_BLOCKS = {
    "cfg_scale": lambda p: p.cfg_scale > 0,
    "alg_temp": lambda p: bool(p.alg_temp),
    "early_stop": lambda p: bool(p.early_stop),  # before multi_block, which it implies
    "multi_block": lambda p: wants_multi_block(p),
    "use_local_leap": lambda p: bool(p.use_local_leap),
    "factor": lambda p: p.factor is not None,
    "anchor_threshold": lambda p: p.anchor_threshold is not None,
    "neighbor_threshold": lambda p: p.neighbor_threshold is not None,
    "leap_radius": lambda p: p.leap_radius is not None,
    "cache_delay_iter": lambda p: p.cache_delay_iter is not None,
    "refresh_interval": lambda p: p.refresh_interval is not None,
}


def resolve_block_diffusion(
    p: SamplingParams,
    *,
    family: str,
    model_block: int,
    max_canvas: int,
    default_max_tokens: int,
) -> ResolvedParams:
    """A block-diffusion request: `steps` per block (at most the block), one of the published
    commit rules, the block the model was trained with unless the request names one. The
    keys of the LLaDA/Dream accelerations do not apply and are refused by name."""
    for key, given in _NOT_FOR_BLOCKS.items():
        if given(p):
            raise InvalidRequestError(key, f"does not apply to block-diffusion models ({family})")
    if p.cache not in ("none", None):
        raise InvalidRequestError(
            "cache",
            "block-diffusion models always decode over their exact KV cache of finished "
            "blocks; prefix/dual apply to LLaDA and Dream",
        )
    max_tokens = min(default_max_tokens, max_canvas) if p.max_tokens is None else p.max_tokens
    if max_tokens > max_canvas:
        raise InvalidRequestError("max_tokens", f"must be <= {max_canvas} (server limit)")
    block = model_block if p.block_length is None else p.block_length
    steps = block if p.steps is None else p.steps
    if steps > block:
        raise InvalidRequestError(
            "steps", f"counts steps per block: at most block_length ({block})"
        )
    if family == "llada2":  # LLaDA2 generate(): steps = min(steps, gen_length // minimal_topk)
        steps = min(steps, max_tokens)
    algorithm = p.algorithm or "low_confidence_dynamic"
    if algorithm not in BLOCK_ALGORITHMS:
        raise InvalidRequestError(
            "algorithm",
            f"block-diffusion models take {', '.join(BLOCK_ALGORITHMS)} (got {algorithm})",
        )
    if algorithm == "multi_bd" and p.steps is not None:
        raise InvalidRequestError(
            "steps", "multi_bd has no step schedule: it commits by confidence (threshold)"
        )
    threshold = p.threshold
    if algorithm == "multi_bd" and threshold is None:
        threshold = MULTI_BD_THRESHOLDS.get(family, DEFAULT_THRESHOLD)
    if algorithm == "low_confidence_dynamic" and threshold is None:
        threshold = BLOCK_CONFIDENCE_DEFAULTS.get(family, DEFAULT_THRESHOLD)
    if algorithm == "entropy_bounded" and threshold is None:
        threshold = DEFAULT_EB_THRESHOLD
    if algorithm == "entropy_bounded" and steps + 1 < block:
        # SDAR's loop gives a block steps + 1 forwards and then leaves it, masks and all
        # (its keys never cached); one commit a forward fills it only with steps >= block - 1
        raise InvalidRequestError(
            "steps",
            f"entropy_bounded: SDAR leaves a block after steps + 1 forwards even with masks "
            f"left; give steps >= block_length - 1 ({block - 1}) or another algorithm",
        )
    if algorithm == "joint_threshold" and threshold is None:
        threshold = DEFAULT_JOINT_THRESHOLD
    for owner, keys in BLOCK_ALGORITHM_KEYS.items():
        for key in keys:
            if algorithm != owner and getattr(p, key) is not None:
                raise InvalidRequestError(key, f"applies to algorithm {owner} only")
    if algorithm == "joint_threshold" and p.max_nfe is not None:
        raise InvalidRequestError("max_nfe", "does not apply to joint_threshold (token editing)")
    if threshold is not None and algorithm in ("low_confidence_static", "sequential"):
        raise InvalidRequestError("threshold", f"algorithm {algorithm} takes no threshold")
    if algorithm in ("low_confidence_dynamic", "joint_threshold", "multi_bd") and threshold > 1.0:
        raise InvalidRequestError("threshold", f"must be in (0, 1] for {algorithm}")
    return ResolvedParams(
        max_tokens=max_tokens,
        steps=steps,
        block_length=block,
        algorithm=algorithm,
        threshold=threshold,
        alg_temp=None,
        cfg_scale=0.0,
        cache="none",
        **_shared_fields(p),
        block_diffusion=True,
        edit_threshold=DEFAULT_EDIT_THRESHOLD if p.edit_threshold is None else p.edit_threshold,
        max_post_edit_steps=(
            DEFAULT_POST_EDIT_STEPS if p.max_post_edit_steps is None else p.max_post_edit_steps
        ),
        buffer_size=DEFAULT_BUFFER_SIZE if p.buffer_size is None else p.buffer_size,
        add_block_threshold=(
            DEFAULT_ADD_BLOCK_THRESHOLD if p.add_block_threshold is None else p.add_block_threshold
        ),
        semi_complete_threshold=(
            DEFAULT_SEMI_COMPLETE_THRESHOLD
            if p.semi_complete_threshold is None
            else p.semi_complete_threshold
        ),
    )
