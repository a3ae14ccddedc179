"""Engine settings of one Triton model instance: ``config.pbtxt`` parameters, then env var
overrides, typed and checked by the server-settings registry (``dlm_protocol.settings``).

Env vars exist so one committed ``model_repository/`` serves other checkpoints or devices
without editing ``config.pbtxt`` (Docker, ``dlm-triton serve --model NAME --dtype ...``).
Kept free of Triton imports so it can be unit-tested.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm_protocol import settings


@dataclass(frozen=True)
class InstanceSettings:
    """What one instance resolved: ``values`` holds the configured settings, typed (always
    ``model`` and ``device``); a setting not configured there is the engine's default."""

    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        """A setting's value: configured, else the registry's default."""
        setting = settings.BY_NAME.get(name)
        if setting is None:
            raise AttributeError(name)
        return self.values.get(name, setting.default)

    def configured(self, name: str) -> bool:
        """Whether the config or the environment set ``name`` (else the engine decides)."""
        return name in self.values


def config_parameters(model_config: dict) -> dict[str, str]:
    """``parameters { key: .. value: { string_value: .. } }`` of a parsed model config."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def resolve_settings(
    params: Mapping[str, str],
    *,
    kind: str = "CPU",
    device_id: int = 0,
    model_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> InstanceSettings:
    """Merge config parameters and env overrides; pin ``cuda`` to this instance's GPU."""
    env = os.environ if environ is None else environ
    # upper-case keys are the Python backend's own (EXECUTION_ENV_PATH, ...), not settings
    merged = {k: v for k, v in params.items() if v != "" and not k.isupper()}
    for setting in settings.SETTINGS:
        if env.get(setting.env):
            merged[setting.param] = env[setting.env]
    if "checkpoint" not in merged:
        raise ValueError("model config has no 'checkpoint' parameter (nor DLM_CHECKPOINT)")
    values = settings.parse_parameters(merged)
    values["model"] = settings.resolve_checkpoint(values["model"], model_dir)
    device = values.get("device") or ("cuda" if kind == "GPU" else "cpu")
    if device == "cuda" and kind == "GPU":
        device = f"cuda:{device_id}"  # one engine per listed GPU
    values["device"] = device
    return InstanceSettings(values)
