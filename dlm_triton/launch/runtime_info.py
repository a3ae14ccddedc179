"""How a loaded model instance runs (dtype and why, device, torch threads), read back from its
``dlm_model_info`` metric (dlm_triton/backend/metrics.py) so the launcher's ready line says what the
model itself chose, not what the launcher guesses."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^dlm_model_info\{(?P<labels>.*)\}\s+1(?:\.0)?\s*$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)


def model_info(metrics_text: str, model: str) -> dict[str, str]:
    """The labels of ``model``'s first ``dlm_model_info`` sample (minus model and instance),
    or {} when the metric is absent (metrics off, or not loaded yet)."""
    for match in _SAMPLE.finditer(metrics_text):
        labels = {k: _unescape(v) for k, v in _LABEL.findall(match.group("labels"))}
        if labels.get("model") == model:
            return {k: v for k, v in labels.items() if k not in ("model", "instance")}
    return {}


_FALLBACKS = re.compile(r"^dlm_fused_kernel_fallbacks\{(?P<labels>.*)\}\s+(?P<value>\S+)\s*$", re.M)


def fused_fallbacks(metrics_text: str, model: str) -> int | None:
    """Compiled kernels of ``model``'s instances that fell back to eager for good (summed over
    instances), from ``dlm_fused_kernel_fallbacks``; None when the metric is absent. A fallback
    is a silent slowdown otherwise: the ready line shows it."""
    total, seen = 0, False
    for match in _FALLBACKS.finditer(metrics_text):
        labels = dict(_LABEL.findall(match.group("labels")))
        if labels.get("model") == model:
            total += int(float(match.group("value")))
            seen = True
    return total if seen else None
