"""GET /v1/limits: every served model with the request parameters it accepts and their ranges.

Clients (the playground first) build their controls from this instead of hard-coding ranges.
Ranges and choices come from the request schema (the one place they are declared); the
per-model ceilings come from the model's Triton config (`max_canvas`, `max_prompt`) and the
proxy's own limits (`--max-tokens-limit`, `--max-n`).
"""

from __future__ import annotations

import asyncio
from functools import cache
from typing import Any

from fastapi import APIRouter, Depends, Request

from dlm_protocol import params

from .config import ProxyConfig
from .dependencies import require_api_key
from .errors import ProxyError, ServiceUnavailable
from .schemas import DIFFUSION_KEYS

router = APIRouter(dependencies=[Depends(require_api_key)])

# Request fields worth a control, in the order a form shows them (stream_mode is the client's
# choice of transport, not a diffusion setting).
PARAMETERS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    *(k for k in DIFFUSION_KEYS if k != "stream_mode"),
)
_JSON_TYPES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string"}


@cache
def parameter_specs() -> dict[str, dict[str, Any]]:
    """{name: {type, minimum, maximum, exclusiveMinimum, enum, description}} from the request
    contract (dlm_protocol.params: the one place the ranges are written)."""
    specs: dict[str, dict[str, Any]] = {}
    for name in PARAMETERS:
        p = params.BY_NAME[name]
        spec: dict[str, Any] = {"type": _JSON_TYPES.get(p.kind, p.kind)}
        if p.choices:
            spec["type"], spec["enum"] = "string", list(p.choices)
        if p.minimum is not None:
            spec["exclusiveMinimum" if p.exclusive_minimum else "minimum"] = p.minimum
        if p.maximum is not None:
            spec["maximum"] = p.maximum
        spec["description"] = p.doc
        specs[name] = spec
    return specs


def _int_param(params: dict[str, Any], key: str) -> int | None:
    raw = params.get(key, {}).get("string_value", "")
    try:
        return int(raw)
    except ValueError:
        return None


def model_limits(model: str, triton_config: dict[str, Any], cfg: ProxyConfig) -> dict[str, Any]:
    """One model's entry: the shared specs with this model's ceilings applied."""
    tparams = triton_config.get("parameters", {})
    canvas = _int_param(tparams, "max_canvas")
    max_tokens = min(cfg.max_tokens_limit, canvas) if canvas else cfg.max_tokens_limit
    specs = {name: dict(spec) for name, spec in parameter_specs().items()}
    for name in ("max_tokens", "steps", "block_length"):
        # steps and block_length are further bounded by the request's own max_tokens.
        specs[name]["maximum"] = min(specs[name].get("maximum", max_tokens), max_tokens)
    return {
        "id": model,
        "object": "model.limits",
        "max_tokens": max_tokens,
        "max_prompt_tokens": _int_param(tparams, "max_prompt"),
        "max_batch_rows": int(triton_config.get("max_batch_size", 0) or 0) or None,
        "parameters": specs,
    }


@router.get("/v1/limits", summary="Served models and the ranges of the parameters they accept")
async def list_limits(request: Request) -> Any:
    backend = request.app.state.backend
    cfg: ProxyConfig = request.app.state.config
    if not backend.any_ready():
        await backend.refresh()
        if not backend.any_ready():
            raise ServiceUnavailable(
                "Triton is not ready", cfg.retry_after_s, code="triton_unavailable"
            )
    models = backend.ready_models()
    configs = await asyncio.gather(
        *(backend.model_config(m) for m in models), return_exceptions=True
    )
    data = []
    for model, conf in zip(models, configs, strict=True):
        if isinstance(conf, ProxyError):  # unloaded between the listing and the config call
            continue
        if isinstance(conf, BaseException):
            raise conf
        data.append(model_limits(model, conf, cfg))
    return {
        "object": "list",
        "data": data,
        "max_n": cfg.max_n,
        "max_fanout": cfg.max_fanout,
        "max_request_bytes": cfg.max_request_bytes,
    }
