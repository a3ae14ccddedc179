"""Proxy-side counters in Prometheus text format (Triton's own are on its metrics port)."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from typing import TYPE_CHECKING

from .converters import ChoiceResult

if TYPE_CHECKING:
    from .triton_backend import TritonBackend


class ProxyMetrics:
    """Requests by route and status, calls in flight (for the drain), tokens, disconnects."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.in_flight = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.disconnects = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight <= 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except (TimeoutError, asyncio.TimeoutError):
            return False

    def count_tokens(self, results: list[ChoiceResult]) -> None:
        seen: dict[int, int] = {}
        for r in results:
            seen[r.prompt_index] = max(seen.get(r.prompt_index, 0), r.prompt_tokens)
            self.completion_tokens += r.completion_tokens
        self.prompt_tokens += sum(seen.values())

    def render(self, backend: TritonBackend, triton_metrics_url: str) -> str:
        lines = [
            f"# Triton and model metrics (nv_*, dlm_*): {triton_metrics_url}",
            "# HELP dlm_proxy_requests_total HTTP requests by route and status.",
            "# TYPE dlm_proxy_requests_total counter",
        ]
        for (route, status), count in sorted(self.requests.items()):
            lines.append(f'dlm_proxy_requests_total{{route="{route}",status="{status}"}} {count}')
        gauges = {
            "dlm_proxy_in_flight_requests": ("Requests being served now.", self.in_flight),
            "dlm_proxy_triton_ready": (
                "Triton URLs that answered ready at the last probe.",
                sum(1 for h in backend.health() if h["ready"]),
            ),
            "dlm_proxy_gc_frozen_objects": (
                "Objects frozen at startup (gc.freeze), out of the cyclic collector's sight.",
                gc.get_freeze_count(),
            ),
        }
        counters = {
            "dlm_proxy_prompt_tokens_total": (
                "Prompt tokens of finished calls.",
                self.prompt_tokens,
            ),
            "dlm_proxy_completion_tokens_total": (
                "Completion tokens of finished calls.",
                self.completion_tokens,
            ),
            "dlm_proxy_client_disconnects_total": (
                "Calls whose client went away before the end.",
                self.disconnects,
            ),
            "dlm_proxy_triton_streams_total": ("Triton streams opened.", backend.streams_opened),
            "dlm_proxy_triton_streams_cancelled_total": (
                "Triton streams cancelled before their final response.",
                backend.streams_cancelled,
            ),
        }
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, (help_text, value) in counters.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        lines += backend.pool.metrics_lines()  # per-replica series (openai_proxy/replicas.py)
        return "\n".join(lines) + "\n"
