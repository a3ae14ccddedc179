"""Generate ``dashboards/dlm-triton.json``, the Grafana dashboard of the compose monitoring profile.

Written as code because Grafana's JSON is long and repetitive: the metric names live in one
table here, so renaming a metric in the Triton adapter is a one-line change.
``python docker/grafana/build_dashboard.py --check`` exits 1 when the committed JSON is stale
(tests/integration/test_compose.py runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "dlm-triton.json"
# Kustomize reads files only under its own directory, so the Kubernetes monitoring component
# ships a copy (docker/kubernetes/components/monitoring); written and checked with the original.
K8S_COPY = OUT.parents[2] / "kubernetes" / "components" / "monitoring" / "dlm-triton.json"
DATASOURCE = {"type": "prometheus", "uid": "dlm-prometheus"}

# Our metrics (dlm_triton/backend/metrics.py, openai_proxy/metrics.py) and Triton's own (nv_*), by role.
M = {
    "rows_per_step": "dlm_rows_per_step",  # histogram: rows in each engine forward
    "step_seconds": "dlm_step_duration_seconds",  # histogram: one engine step
    "queue_depth": "dlm_queue_depth",  # gauge: waiting for a row, not yet in the batch
    "in_flight": "dlm_requests_in_flight",  # gauge: accepted, not finished (waiting + running)
    "ttft_seconds": "dlm_time_to_first_token_seconds",  # histogram
    "e2e_seconds": "dlm_request_latency_seconds",  # histogram
    "tokens_total": "dlm_generated_tokens_total",  # counter
    "requests_total": "dlm_requests_total",  # counter, label outcome
    "tokens_per_forward": "dlm_tokens_per_forward",  # histogram, per finished request
    "steps_per_request": "dlm_steps_per_request",  # histogram
    "proxy_requests": "dlm_proxy_requests_total",  # counter, labels route, status
    "proxy_in_flight": "dlm_proxy_in_flight_requests",  # gauge
    # Per Triton replica, as the proxy sees it (openai_proxy/replicas.py), label replica.
    "replica_in_flight": "dlm_proxy_replica_in_flight",  # gauge
    "replica_up": "dlm_proxy_replica_up",  # gauge, 1 while it gets new requests
    "replica_failures": "dlm_proxy_replica_failures_total",  # counter
    "replica_retries": "dlm_proxy_replica_retries_total",  # counter
    "nv_pending": "nv_inference_pending_request_count",
    "nv_gpu_util": "nv_gpu_utilization",
    "nv_gpu_mem_used": "nv_gpu_memory_used_bytes",
    "nv_gpu_mem_total": "nv_gpu_memory_total_bytes",
    "nv_gpu_power": "nv_gpu_power_usage",
}


def _quantiles(metric: str, by: str = "model") -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram over the dashboard's rate window."""
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket[$__rate_interval])))",
            f"p{int(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def _mean(metric: str, by: str = "model") -> str:
    return (
        f"sum by ({by}) (rate({metric}_sum[$__rate_interval]))"
        f" / sum by ({by}) (rate({metric}_count[$__rate_interval]))"
    )


class Layout:
    """Places panels on Grafana's 24-column grid, two per line, rows between sections."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "id": self._id(),
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def timeseries(
        self, title: str, targets: list[tuple[str, str]], unit: str, description: str
    ) -> None:
        self.panels.append(
            {
                "type": "timeseries",
                "title": title,
                "description": description,
                "id": self._id(),
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": 12, "x": self.x, "y": self.y},
                "fieldConfig": {
                    "defaults": {"unit": unit, "custom": {"fillOpacity": 10}},
                    "overrides": [],
                },
                "options": {
                    "legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"},
                },
                "targets": [
                    {"refId": chr(65 + i), "datasource": DATASOURCE, "expr": e, "legendFormat": lg}
                    for i, (e, lg) in enumerate(targets)
                ],
            }
        )
        if self.x:
            self.x = 0
            self.y += 8
        else:
            self.x = 12

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def build() -> dict[str, Any]:
    """The dashboard as a dict (Grafana schema 39)."""
    g = Layout()
    g.row("Throughput")
    g.timeseries(
        "Generated tokens/s",
        [(f"sum by (model) (rate({M['tokens_total']}[$__rate_interval]))", "{{model}}")],
        "short",
        "Committed completion tokens per second (canvas padding not counted).",
    )
    g.timeseries(
        "Finished requests/s by outcome",
        [
            (
                f"sum by (model, outcome) (rate({M['requests_total']}[$__rate_interval]))",
                "{{model}} {{outcome}}",
            )
        ],
        "reqps",
        "stop / length / abort / error / invalid / overloaded per second.",
    )
    g.row("Latency")
    g.timeseries(
        "Time to first token",
        _quantiles(M["ttft_seconds"]),
        "s",
        "From Triton handing the request to the model until the first stable text is sent.",
    )
    g.timeseries(
        "End-to-end latency",
        _quantiles(M["e2e_seconds"]),
        "s",
        "From arrival in the model until the final response.",
    )
    g.row("Engine steps and queue")
    g.timeseries(
        "Rows per step (batch size)",
        [(_mean(M["rows_per_step"]), "mean {{model}}")] + _quantiles(M["rows_per_step"])[2:],
        "short",
        "How many requests share one denoising forward.",
    )
    g.timeseries(
        "Queue depth",
        [
            (f"sum by (model) ({M['queue_depth']})", "waiting for a row {{model}}"),
            (f"sum by (model) ({M['in_flight']})", "in flight {{model}}"),
            (f"sum by (model) ({M['nv_pending']})", "Triton pending {{model}}"),
        ],
        "short",
        "Requests waiting for a free row of the batch, requests accepted and not finished "
        "(waiting + running), and requests Triton holds before execute().",
    )
    g.timeseries(
        "Step time",
        [(_mean(M["step_seconds"]), "mean {{model}}")] + _quantiles(M["step_seconds"])[1:],
        "s",
        "Duration of one engine step (one batched forward plus selection).",
    )
    g.timeseries(
        "Tokens per forward",
        [(_mean(M["tokens_per_forward"]), "mean {{model}}")],
        "short",
        "Completion tokens committed per denoising forward (> 1 with threshold decoding).",
    )
    g.row("GPU")
    g.timeseries(
        "GPU utilisation",
        [(f"{M['nv_gpu_util']} * 100", "{{gpu_uuid}}")],
        "percent",
        "Triton's nv_gpu_utilization (needs --allow-gpu-metrics, on by default on GPU hosts).",
    )
    g.timeseries(
        "GPU memory used",
        [
            (M["nv_gpu_mem_used"], "used {{gpu_uuid}}"),
            (M["nv_gpu_mem_total"], "total {{gpu_uuid}}"),
        ],
        "bytes",
        "Weights, KV/prefix caches and activations.",
    )
    g.timeseries(
        "GPU power",
        [(M["nv_gpu_power"], "{{gpu_uuid}}")],
        "watt",
        "Power draw per GPU.",
    )
    g.row("OpenAI proxy")
    g.timeseries(
        "Proxy responses/s by status",
        [
            (
                f"sum by (route, status) (rate({M['proxy_requests']}[$__rate_interval]))",
                "{{route}} {{status}}",
            )
        ],
        "reqps",
        "HTTP answers of the proxy: 4xx are client errors, 429/503 mean Triton is saturated.",
    )
    g.timeseries(
        "Proxy calls in flight",
        [(f"sum({M['proxy_in_flight']})", "in flight")],
        "short",
        "Chat and completion calls being served (streams included).",
    )
    g.timeseries(
        "Requests in flight per Triton replica",
        [
            (f"sum by (replica) ({M['replica_in_flight']})", "{{replica}}"),
            (f"sum({M['replica_up']})", "replicas in use"),
        ],
        "short",
        "What the proxy balances on (fewest in flight first), and how many replicas get work.",
    )
    g.timeseries(
        "Replica failures and retries/s",
        [
            (
                f"sum by (replica) (rate({M['replica_failures']}[$__rate_interval]))",
                "failed {{replica}}",
            ),
            (
                f"sum by (replica) (rate({M['replica_retries']}[$__rate_interval]))",
                "moved away {{replica}}",
            ),
        ],
        "reqps",
        "Streams that broke on a replica, and requests moved to another before any token.",
    )
    return {
        "uid": "dlm-triton",
        "title": "dlm-triton",
        "tags": ["dlm-triton", "triton", "diffusion-lm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": g.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        for out in (OUT, K8S_COPY):
            if not out.exists() or out.read_text() != text:
                print(f"stale: {out} (run python {Path(__file__).name})", file=sys.stderr)
                return 1
        return 0
    for out in (OUT, K8S_COPY):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
