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
from .decoding.strategies import (
    MULTI_BLOCK,
    STRATEGIES,
    UNIFORM_STRATEGY,
    BlockStrategy,
    Strategy,
    strategy_of,
)
from .decoding.strategies.factor import DEFAULT_FACTOR
from .decoding.strategies.joint_threshold import DEFAULT_EDIT_THRESHOLD, DEFAULT_POST_EDIT_STEPS
from .decoding.strategies.local_leap import (
    DEFAULT_ANCHOR_THRESHOLD,
    DEFAULT_LEAP_RADIUS,
    DEFAULT_NEIGHBOR_THRESHOLD,
)
from .decoding.strategies.multi_block import (
    BLOCK_KEYS,
    DEFAULT_BLOCK_ADD_THRESHOLD,
    DEFAULT_CACHE_DELAY_ITER,
    DEFAULT_DECODED_TOKEN_THRESHOLD,
    DEFAULT_RULE,
    resolve_cache,
    wants_multi_block,
)
from .errors import InvalidRequestError
from .models import Family, family_of
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
    edit_threshold: float = DEFAULT_EDIT_THRESHOLD  # LLaDA2.1 token editing (joint_threshold)
    max_post_edit_steps: int = DEFAULT_POST_EDIT_STEPS
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
    family: Family | str,
    default_algorithm: str,
    uses_blocks: bool,
    max_canvas: int,
    default_max_tokens: int,
    model_defaults: dict[str, Any] | None = None,
    model_block: int = 0,
) -> ResolvedParams:
    """Check `p` against the family and limits, fill defaults; raise on the first bad field.

    The rules of each decoding strategy (its keys, threshold, checks) are the strategy's own
    (`decoding/strategies/`); this function applies what every request shares and asks the
    strategy the request names. `model_defaults` are the checkpoint's own decoding defaults
    (e.g. d3LLM's multi-block settings), applied to keys the request left unset.
    `model_block` > 0 marks a block-diffusion model (SDAR, LLaDA2) and is its trained block
    length."""
    family = family_of(family)
    if family.uniform_diffusion:  # uniform-state diffusion: its sampler's own settings
        return UNIFORM_STRATEGY.resolve_request(
            p, model_defaults or {}, max_canvas, default_max_tokens
        )
    UNIFORM_STRATEGY.refuse_keys(p)
    p = apply_model_defaults(p, model_defaults)
    if model_block:
        return resolve_block_diffusion(
            p,
            family=family,
            model_block=model_block,
            max_canvas=max_canvas,
            default_max_tokens=default_max_tokens,
        )
    block_rules = [s for s in STRATEGIES.values() if isinstance(s, BlockStrategy)]
    for rule in block_rules:
        for key in rule.keys:
            if getattr(p, key) is not None:
                raise InvalidRequestError(
                    key, f"applies to block-diffusion models (SDAR, LLaDA2; {rule.name})"
                )
    for rule in block_rules:  # proven against SDAR/LLaDA2 loops only
        if p.algorithm == rule.name:
            raise InvalidRequestError("algorithm", rule.canvas_refusal())
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
    rule = strategy_of(algorithm)
    if rule.family_specific and algorithm not in family.own_algorithms:
        raise InvalidRequestError("algorithm", rule.family_refusal(family))
    threshold = rule.threshold_for(family) if p.threshold is None else p.threshold
    if rule.threshold_kind != "entropy" and threshold is not None and threshold > 1.0:
        raise InvalidRequestError(
            "threshold",
            f"must be in (0, 1] for a confidence rule (up to {MAX_ENTROPY_THRESHOLD:g} nats "
            "only with entropy_threshold)",
        )
    rule.refuse_threshold(p.threshold)
    if p.cfg_scale > 0 and not family.supports_cfg:
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
        accel=resolve_acceleration(p, rule=rule, family=family, steps=steps, block=block),
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


@dataclass(frozen=True)
class Acceleration:
    """The resolved settings of the accelerated rules (unused fields stay at their defaults;
    each is its strategy's: decoding/strategies/factor.py, local_leap.py, multi_block.py)."""

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


def apply_model_defaults(p: SamplingParams, defaults: dict[str, Any] | None) -> SamplingParams:
    """The checkpoint's decoding defaults for keys the request did not set."""
    if not defaults:
        return p
    rule_given = any(getattr(p, k) is not None for k in _RULE_KEYS)
    # d3LLM's early stop is published for its no-cache loop (see MultiBlock.check_request)
    skip = ("early_stop",) if resolve_cache(p) == "prefix" else ()
    fill = {
        k: v
        for k, v in defaults.items()
        if getattr(p, k, None) is None
        and not (rule_given and k in _RULE_KEYS + BLOCK_KEYS + ("early_stop",))
        and k not in skip
    }
    if not fill:
        return p
    return SamplingParams(**{k: getattr(p, k) for k in p.given}, **fill)


def wants_blocks(p: SamplingParams) -> bool:
    """Multi-block and strategies that decode in blocks (d3LLM's entropy threshold) use
    blocks (32 by default) on every family, as published; Dream otherwise uses the canvas."""
    if wants_multi_block(p):
        return True
    return p.algorithm is not None and strategy_of(p.algorithm).decodes_in_blocks


def pick_algorithm(p: SamplingParams) -> str | None:
    """The algorithm named by the request, including the seeds' switches and the keys that
    imply their strategy (`factor`, LocalLeap's keys, multi-block's)."""
    for s in STRATEGIES.values():
        if s.switch and getattr(p, s.switch):
            if p.algorithm not in (None, s.name):
                raise InvalidRequestError(
                    s.switch, f"selects {s.name}; it conflicts with algorithm={p.algorithm}"
                )
            return s.name
    if p.algorithm:
        return p.algorithm
    for s in STRATEGIES.values():
        if s.implied_by_keys and any(getattr(p, k) is not None for k in s.keys):
            return s.name
    if wants_multi_block(p):  # d3LLM's rule; its `threshold` is the entropy bound
        return DEFAULT_RULE
    return None


def resolve_acceleration(
    p: SamplingParams, *, rule: Strategy, family: Family, steps: int, block: int
) -> Acceleration:
    """The keys of the canvas strategies: each refused unless its strategy runs, checked
    and defaulted by it."""
    for s in STRATEGIES.values():
        if s is rule or not s.selected_by_algorithm or isinstance(s, BlockStrategy):
            continue
        for key in s.keys:
            if getattr(p, key) is not None:
                raise InvalidRequestError(key, f"applies to algorithm {s.name} only")
    rule.check(p, family=family, steps=steps, block=block)
    fields = rule.resolved_fields(p)
    if wants_multi_block(p):
        MULTI_BLOCK.check_request(p, rule)
        fields |= MULTI_BLOCK.resolved_fields(p)
    else:
        MULTI_BLOCK.refuse_keys(p)
    if not rule.takes_alg_temp and p.alg_temp:
        raise InvalidRequestError("alg_temp", f"does not apply to algorithm {rule.name}")
    return Acceleration(**fields)


# ==== block-diffusion models (SDAR generate.py `block_diffusion_generate`, LLaDA2
# `generate`): the published rules are the block strategies (decoding/strategies/sdar.py,
# joint_threshold.py, multi_bd.py), their thresholds the family's (`Family.default_thresholds`).
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
DEFAULT_BLOCK_ALGORITHM = "low_confidence_dynamic"  # SDAR generate.py's default remasking


def resolve_block_diffusion(
    p: SamplingParams,
    *,
    family: Family,
    model_block: int,
    max_canvas: int,
    default_max_tokens: int,
) -> ResolvedParams:
    """A block-diffusion request: `steps` per block (at most the block), one of the published
    commit rules, the block the model was trained with unless the request names one. The
    keys of the LLaDA/Dream accelerations do not apply and are refused by name."""
    for key, given in _NOT_FOR_BLOCKS.items():
        if given(p):
            raise InvalidRequestError(
                key, f"does not apply to block-diffusion models ({family.name})"
            )
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
    if family.steps_capped_by_length:  # LLaDA2 generate(): min(steps, gen_length // minimal_topk)
        steps = min(steps, max_tokens)
    algorithm = p.algorithm or DEFAULT_BLOCK_ALGORITHM
    rule = STRATEGIES.get(algorithm)
    if not isinstance(rule, BlockStrategy):
        names = [s.name for s in STRATEGIES.values() if isinstance(s, BlockStrategy)]
        raise InvalidRequestError(
            "algorithm",
            f"block-diffusion models take {', '.join(names)} (got {algorithm})",
        )
    if not rule.step_schedule and p.steps is not None:
        raise InvalidRequestError(
            "steps", f"{rule.name} has no step schedule: it commits by confidence (threshold)"
        )
    threshold = rule.threshold_for(family) if p.threshold is None else p.threshold
    rule.check(p, family=family, steps=steps, block=block)
    for owner in STRATEGIES.values():
        if isinstance(owner, BlockStrategy) and owner is not rule:
            for key in owner.keys:
                if getattr(p, key) is not None:
                    raise InvalidRequestError(key, f"applies to algorithm {owner.name} only")
    rule.refuse_threshold(threshold)
    if rule.threshold_kind == "confidence" and threshold > 1.0:
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
        **rule.resolved_fields(p),
    )
