"""A DiffusionGemma request's settings: its sampler's keys, the checkpoint's defaults, and
the keys of the mask-diffusion families refused by name."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError
from ..sampling_params import ResolvedParams, SamplingParams, _shared_fields
from .grammar import CONSTRAINT_KEYS
from .uniform_diffusion import UniformSettings

UNIFORM_KEYS = ("t_min", "t_max", "stability_threshold", "stop_entropy")
# transformers' DiffusionGemmaGenerationConfig defaults, for keys a checkpoint leaves unset
BUILT_IN = {
    "steps": 48,
    "threshold": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "stop_entropy": 0.005,
}
# request keys a DiffusionGemma request may set (besides these, only their defaults pass)
ACCEPTED = frozenset(
    ("max_tokens", "steps", "threshold", "seed", "stop", "stream_mode", "priority", "logprobs")
    + ("logit_bias",)  # added to each step's logits (uniform_diffusion.py, logit_bias.py)
    + ("cache_salt",)  # the encoder prefix cache's tenant (encoder_prefix.py)
    + UNIFORM_KEYS
    + ("tools", "tool_choice", "parallel_tool_calls")
    + CONSTRAINT_KEYS  # structured output: each finished canvas constrained (uniform_constraints)
)


def uniform_defaults(gen: dict[str, Any]) -> dict[str, Any]:
    """Request-key defaults from a DiffusionGemma generation_config.json."""
    sampler = gen.get("sampler_config") or {}
    pairs = {
        "steps": gen.get("max_denoising_steps"),
        "threshold": sampler.get("entropy_bound") if isinstance(sampler, dict) else None,
        "t_min": gen.get("t_min"),
        "t_max": gen.get("t_max"),
        "stability_threshold": gen.get("stability_threshold"),
        "stop_entropy": gen.get("confidence_threshold"),
        "max_tokens": gen.get("max_new_tokens"),
    }
    return {k: v for k, v in pairs.items() if v is not None}


def refuse_uniform_keys(p: SamplingParams) -> None:
    """Other families: DiffusionGemma's own keys are an error naming the key."""
    for key in UNIFORM_KEYS:
        if getattr(p, key) is not None:
            raise InvalidRequestError(key, "applies to DiffusionGemma models only")


def resolve_uniform(
    p: SamplingParams, defaults: dict[str, Any], max_canvas: int, default_max_tokens: int
) -> ResolvedParams:
    """A DiffusionGemma request: `steps` per canvas, `threshold` the entropy bound, the
    temperature schedule and adaptive stopping; `max_tokens` rounds up to whole canvases
    internally (the text stops at `max_tokens`)."""
    for key in sorted(p.given - ACCEPTED):
        value = getattr(p, key)
        if key == "temperature" and value == 0:  # the OpenAI default: nothing asked
            continue
        if key == "stream_mode" or (key == "top_p" and value == 1):
            continue
        raise InvalidRequestError(
            key,
            "does not apply to DiffusionGemma (its sampler takes steps, threshold = "
            "entropy_bound, t_min, t_max, stability_threshold, stop_entropy, seed)",
        )

    def pick(key: str) -> Any:
        value = getattr(p, key)
        return value if value is not None else defaults.get(key, BUILT_IN.get(key))

    max_tokens = p.max_tokens or defaults.get("max_tokens") or default_max_tokens
    max_tokens = min(max_tokens, max_canvas) if p.max_tokens is None else max_tokens
    if max_tokens > max_canvas:
        raise InvalidRequestError("max_tokens", f"must be <= {max_canvas} (server limit)")
    t_min, t_max = float(pick("t_min")), float(pick("t_max"))
    if t_max <= t_min:
        raise InvalidRequestError("t_max", f"must be above t_min ({t_min})")
    shared = _shared_fields(p)
    settings = UniformSettings(
        steps=int(pick("steps")),
        t_min=t_min,
        t_max=t_max,
        entropy_bound=float(pick("threshold")),
        stability_threshold=int(pick("stability_threshold")),
        stop_entropy=float(pick("stop_entropy")),
        canvases=0,  # set by the engine, which knows the canvas length
    )
    return ResolvedParams(
        max_tokens=max_tokens,
        steps=max_tokens,  # the mask families' schedule fields, unused by these rows
        block_length=max_tokens,
        algorithm="uniform",
        threshold=None,
        alg_temp=None,
        cfg_scale=0.0,
        cache="none",
        **shared,
        uniform=settings,
    )
