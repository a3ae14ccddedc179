"""Engine settings of one Triton model instance: config parameters, then env var overrides.

Env vars exist so one committed ``model_repository/`` serves other checkpoints or devices
without editing ``config.pbtxt`` (Docker, ``dlm-triton serve --model NAME --dtype ...``).
Kept free of Triton imports so it can be unit-tested.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dlm_protocol import limits

# parameter key -> env var that overrides it
ENV_OVERRIDES = {
    "checkpoint": "DLM_CHECKPOINT",
    "revision": "DLM_REVISION",
    "dtype": "DLM_DTYPE",
    "device": "DLM_DEVICE",
    "quantization": "DLM_QUANTIZATION",
    "max_rows": "DLM_MAX_ROWS",
    "max_canvas": "DLM_MAX_CANVAS",
    "max_prompt": "DLM_MAX_PROMPT",
    "max_queue": "DLM_MAX_QUEUE",
    # block-diffusion models' KV page pool and prefix cache (dlm_engine/paged_kv.py)
    "kv_cache_tokens": "DLM_KV_CACHE_TOKENS",
    "kv_cache_memory_fraction": "DLM_KV_CACHE_MEMORY_FRACTION",
    "prefix_cache_tokens": "DLM_PREFIX_CACHE_TOKENS",
    # scheduling and graph capture (dlm_engine/config.py says what each does)
    "phase_wait_steps": "DLM_PHASE_WAIT_STEPS",
    "cuda_graph_max_tokens": "DLM_CUDA_GRAPH_MAX_TOKENS",
    "admission_window_ms": "DLM_ADMISSION_WINDOW_MS",
    "admission_gap_ms": "DLM_ADMISSION_GAP_MS",
    "admission_burst_gap_ms": "DLM_ADMISSION_BURST_GAP_MS",
    "score_step_tokens": "DLM_SCORE_STEP_TOKENS",
    # ranks the weights are split over (dlm_engine/parallel/): this instance's engine is rank 0
    "tensor_parallel_size": "DLM_TENSOR_PARALLEL_SIZE",
}
# unset: the engine's defaults (EngineConfig)
INT_KEYS = (
    "max_rows",
    "max_canvas",
    "max_prompt",
    "max_queue",
    "kv_cache_tokens",
    "prefix_cache_tokens",
    "phase_wait_steps",
    "cuda_graph_max_tokens",
    "score_step_tokens",
    "tensor_parallel_size",
)
FLOAT_KEYS = (
    "kv_cache_memory_fraction",
    "admission_window_ms",
    "admission_gap_ms",
    "admission_burst_gap_ms",
)
OPTIONAL_KEYS = (
    "kv_cache_tokens",
    "kv_cache_memory_fraction",
    "prefix_cache_tokens",
    "phase_wait_steps",
    "cuda_graph_max_tokens",
    "admission_window_ms",
    "admission_gap_ms",
    "admission_burst_gap_ms",
    "score_step_tokens",
    "tensor_parallel_size",
)
ASSETS_DIR = Path(__file__).resolve().parent.parent / "dlm_engine" / "assets"


@dataclass
class InstanceSettings:
    checkpoint: str
    revision: str | None = None  # Hub revision when checkpoint is a Hub id
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str = "none"
    max_rows: int = limits.MAX_ROWS
    max_canvas: int = limits.MAX_CANVAS
    max_prompt: int = limits.MAX_PROMPT
    max_queue: int = limits.MAX_QUEUE
    kv_cache_tokens: int | None = None  # None: EngineConfig's default
    kv_cache_memory_fraction: float | None = None
    prefix_cache_tokens: int | None = None
    phase_wait_steps: int | None = None
    cuda_graph_max_tokens: int | None = None
    admission_window_ms: float | None = None
    admission_gap_ms: float | None = None
    admission_burst_gap_ms: float | None = None
    score_step_tokens: int | None = None
    tensor_parallel_size: int | None = None


def config_parameters(model_config: dict) -> dict[str, str]:
    """``parameters { key: .. value: { string_value: .. } }`` of a parsed model config."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def resolve_checkpoint(value: str, model_dir: Path | None = None) -> str:
    """A path if one exists (absolute, relative to the model folder, or an embedded asset);
    otherwise the value unchanged (a hub id for the engine's loader)."""
    candidates = [Path(value).expanduser()]
    if model_dir is not None:
        candidates.append(model_dir / value)
    candidates.append(ASSETS_DIR / value)
    for path in candidates:
        if path.is_dir():
            return str(path.resolve())
    return value


def resolve_settings(
    params: dict[str, str],
    *,
    kind: str = "CPU",
    device_id: int = 0,
    model_dir: Path | None = None,
    environ: dict[str, str] | None = None,
) -> InstanceSettings:
    """Merge config parameters and env overrides; pin ``cuda`` to this instance's GPU."""
    env = os.environ if environ is None else environ
    merged = {k: v for k, v in params.items() if v != ""}
    for key, var in ENV_OVERRIDES.items():
        if env.get(var):
            merged[key] = env[var]
    if "checkpoint" not in merged:
        raise ValueError("model config has no 'checkpoint' parameter (nor DLM_CHECKPOINT)")
    device = merged.get("device") or ("cuda" if kind == "GPU" else "cpu")
    if device == "cuda" and kind == "GPU":
        device = f"cuda:{device_id}"  # one engine per listed GPU
    typed: dict[str, int | float] = {}
    for keys, cast, kind_of in ((INT_KEYS, int, "an integer"), (FLOAT_KEYS, float, "a number")):
        for key in keys:
            if key in merged:
                try:
                    typed[key] = cast(merged[key])
                except ValueError as exc:
                    raise ValueError(
                        f"parameter {key} must be {kind_of}, got {merged[key]!r}"
                    ) from exc
    return InstanceSettings(
        checkpoint=resolve_checkpoint(merged["checkpoint"], model_dir),
        revision=merged.get("revision") or None,
        dtype=merged.get("dtype", "auto"),
        device=device,
        quantization=merged.get("quantization", "none"),
        **typed,
    )
