"""Reading Triton's Prometheus metrics in tests (a plain module: importable from any test,
unlike a conftest, whose name is shared by every test folder)."""

from __future__ import annotations

import re
import time
import urllib.request

from dlm_triton.launch.launcher import TritonServerProcess

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(server: TritonServerProcess) -> dict[tuple[str, str], float]:
    """Prometheus text -> {(name, labels): value} (labels as written by Triton)."""
    with urllib.request.urlopen(server.urls["metrics"], timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[(match.group(1), match.group(2) or "")] = float(match.group(3))
    return samples


def read_metric(server: TritonServerProcess, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for (sample, label_text), value in scrape(server).items():
        if sample == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += value
    return total


def settled_metric(
    server: TritonServerProcess, name: str, quiet_s: float = 0.5, timeout_s: float = 30
) -> float:
    """``read_metric`` once it has stopped changing for ``quiet_s``. Step figures (rows and
    wall time per step, prefix-cache tokens) are recorded in a batch right after the engine's
    last final response (dlm_triton.backend.step_metrics), so a client holding its answer may read
    them a moment early."""
    deadline = time.monotonic() + timeout_s
    value = read_metric(server, name)
    while True:
        time.sleep(quiet_s)
        again = read_metric(server, name)
        if again == value or time.monotonic() > deadline:
            return again
        value = again
