"""The ``dlm_*`` Prometheus metrics of one model instance (Triton's metrics port).

Triton's own ``nv_inference_*`` latency stops at ``execute()`` for decoupled models, so time to
first token, end-to-end latency, steps and batch size are ours. Two instances' same-named
metrics merge unless labelled: every metric carries ``model`` and ``instance``.
"""

from __future__ import annotations

import threading
from typing import Any

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
ROWS_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
STEPS_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
TOKENS_PER_FORWARD_BUCKETS = [0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 16, 32]
OUTCOMES = ("stop", "length", "tool_calls", "abort", "error", "invalid", "overloaded")


class Metrics:
    """Creates the families once per process and one metric per (model, instance, outcome)."""

    _families: dict[str, Any] = {}
    _families_lock = threading.Lock()

    def __init__(self, pb_utils: Any, model: str, instance: str) -> None:
        self.pb = pb_utils
        self.labels = {"model": model, "instance": instance}
        fam = self.pb.MetricFamily
        counter, gauge, hist = fam.COUNTER, fam.GAUGE, fam.HISTOGRAM
        self.requests = {
            o: self._family("dlm_requests_total", "Finished requests by outcome", counter).Metric(
                labels={**self.labels, "outcome": o}
            )
            for o in OUTCOMES
        }
        self.queue_depth = self._metric(
            "dlm_queue_depth", "Requests waiting for a row (not yet in the batch)", gauge
        )
        self.in_flight = self._metric(
            "dlm_requests_in_flight",
            "Requests accepted and not finished (waiting + running)",
            gauge,
        )
        self.rows_per_step = self._metric(
            "dlm_rows_per_step", "Rows (requests) in each engine forward", hist, ROWS_BUCKETS
        )
        self.step_seconds = self._metric(
            "dlm_step_duration_seconds", "Wall time of one engine step", hist, LATENCY_BUCKETS
        )
        self.steps_per_request = self._metric(
            "dlm_steps_per_request", "Forwards used by a finished request", hist, STEPS_BUCKETS
        )
        self.tokens_per_forward = self._metric(
            "dlm_tokens_per_forward",
            "Completion tokens committed per forward, per finished request",
            hist,
            TOKENS_PER_FORWARD_BUCKETS,
        )
        self.ttft = self._metric(
            "dlm_time_to_first_token_seconds",
            "From execute() to the first committed text sent",
            hist,
            LATENCY_BUCKETS,
        )
        self.e2e = self._metric(
            "dlm_request_latency_seconds",
            "From execute() to the final response",
            hist,
            LATENCY_BUCKETS,
        )
        self.generated_tokens = self._metric(
            "dlm_generated_tokens_total", "Completion tokens generated", counter
        )
        # block-diffusion prompt blocks reused from the prefix cache (hit rate =
        # hit / lookup tokens)
        self.prefix_lookup_tokens = self._metric(
            "dlm_prefix_cache_lookup_tokens_total",
            "Whole-block prompt tokens of block-diffusion requests (DiffusionGemma: whole "
            "encoder chunks) looked up in the prefix cache",
            counter,
        )
        self.prefix_hit_tokens = self._metric(
            "dlm_prefix_cache_hit_tokens_total",
            "Of those, tokens whose keys/values were reused instead of computed",
            counter,
        )
        self._prefix_seen = (0, 0)
        self.gc_frozen_objects = self._metric(
            "dlm_gc_frozen_objects",
            "Objects of the model process frozen after load (gc.freeze): out of the cyclic "
            "collector's sight, so its full collections stay short",
            gauge,
        )
        self.fused_fallbacks = self._metric(
            "dlm_fused_kernel_fallbacks",
            "Compiled kernels (norms, rotary, activations, paged attention flex) that fell back "
            "to eager or gathering for good (the compiler failed or hit its recompile limit): "
            "each makes steps slower",
            gauge,
        )
        self.graph_captures = self._metric(
            "dlm_cuda_graph_captures_total",
            "CUDA graphs the engine captured (an eager forward and a capture inside one step, "
            "at the first step of each new shape): still rising under steady traffic means step "
            "shapes keep changing",
            counter,
        )
        self.restarts = self._metric(
            "dlm_model_restarts_total",
            "Times the launcher restarted the server because the model (stub) or server died",
            counter,
        )

    def _family(self, name: str, doc: str, kind: Any) -> Any:
        with self._families_lock:
            if name not in self._families:
                self._families[name] = self.pb.MetricFamily(name=name, description=doc, kind=kind)
            return self._families[name]

    def _metric(self, name: str, doc: str, kind: Any, buckets: list[float] | None = None) -> Any:
        family = self._family(name, doc, kind)
        if buckets is not None:
            return family.Metric(labels=self.labels, buckets=buckets)
        return family.Metric(labels=self.labels)

    def info(self, **labels: str) -> None:
        """``dlm_model_info{model, instance, dtype, dtype_reason, device, torch_threads} 1``: what
        the instance chose at load (read by the launcher's ready line and by dashboards)."""
        fam = self._family(
            "dlm_model_info",
            "Always 1; labels say how the instance runs (dtype and why, device, torch threads)",
            self.pb.MetricFamily.GAUGE,
        )
        self._info = fam.Metric(labels={**self.labels, **labels})  # kept: dropped = unregistered
        self._info.set(1)

    def prefix_cache(self, lookup_tokens: int, hit_tokens: int) -> None:
        """Advance the prefix-cache counters to the engine's running totals."""
        seen_lookup, seen_hit = self._prefix_seen
        if lookup_tokens > seen_lookup:
            self.prefix_lookup_tokens.increment(lookup_tokens - seen_lookup)
        if hit_tokens > seen_hit:
            self.prefix_hit_tokens.increment(hit_tokens - seen_hit)
        self._prefix_seen = (lookup_tokens, hit_tokens)

    def outcome(self, outcome: str) -> None:
        self.requests[outcome if outcome in self.requests else "error"].increment(1)
