"""Headless Locust against the real local CPU stack: tritonserver on the embedded tiny-dlm + the proxy.

The load is ``benchmarks/locustfile.py`` exactly as operators run it, so a broken SSE stream,
a missing usage chunk, a bad finish_reason or a Triton error fails here as a Locust failure.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from embedded_server import embedded_server as serve_embedded

from dlm_triton.launch.launcher import TritonServerProcess, proxy_command
from dlm_triton.launch.procs import spawn

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM by PID, bounded wait, then SIGKILL: the proxy drains on SIGTERM."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# Runs end after this many completed requests of every kind, not after a wall time, so a slow
# machine takes longer instead of failing; the run-time and timeouts only catch a real hang.
STOP_AFTER = 3
HANG_CAP = "600s"


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServerProcess]:
    """tritonserver on the embedded default model (what `dlm-triton serve` serves), free ports."""
    with serve_embedded(tmp_path_factory.mktemp("locust-triton"), ready_timeout_s=600) as server:
        yield server


@pytest.fixture(scope="module")
def proxy_url(
    embedded_server: TritonServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The OpenAI proxy in front of the session's tritonserver, started with the launcher's
    own command line (what ``dlm-triton serve`` runs), stopped by PID."""
    cmd = proxy_command(embedded_server.ports, embedded_server.model_name, "127.0.0.1")
    assert cmd is not None, "openai_proxy has no __main__: the launcher cannot start it"
    log_path = tmp_path_factory.mktemp("proxy") / "proxy.log"
    url = f"http://127.0.0.1:{embedded_server.ports.proxy}"
    with log_path.open("wb") as log:
        proc = spawn(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not _ready(f"{url}/health"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"proxy did not become healthy:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.3)
            yield url
        finally:
            _stop(proc)


def _load_env(server: TritonServerProcess) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLM_LOAD_")}
    env.update(
        DLM_LOAD_MODEL=server.model_name,
        DLM_LOAD_TRITON_GRPC=server.urls["grpc"],
        DLM_LOAD_MAX_TOKENS="16",
        DLM_LOAD_STEPS="8",
        DLM_LOAD_STREAM_FRACTION="0.5",
        DLM_LOAD_TIMEOUT_S="300",
        DLM_LOAD_STOP_AFTER=str(STOP_AFTER),
    )
    return env


def _server_log(server: TritonServerProcess) -> str:
    """The tritonserver log tail: a crash under load shows its signal and stack there."""
    if server.log_path is None or not server.log_path.exists():
        return ""
    return "\n--- tritonserver log tail ---\n" + server.log_path.read_text(errors="replace")[-3000:]


def _stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with path.open(newline="") as fh:
        return {(r["Type"], r["Name"]): r for r in csv.DictReader(fh)}


def test_locust_against_cpu_stack_has_no_failures(
    embedded_server: TritonServerProcess, proxy_url: str, tmp_path: Path
) -> None:
    prefix = tmp_path / "load"
    cmd = _run_load_module().locust_command(4, proxy_url, prefix, run_time=HANG_CAP)
    proc = subprocess.run(
        cmd,
        env=_load_env(embedded_server),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert "every kind completed" in proc.stdout + proc.stderr, "hit the hang cap: " + (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    output = proc.stdout[-4000:] + proc.stderr[-4000:] + _server_log(embedded_server)
    rows = _stats(Path(f"{prefix}_stats.csv"))
    aggregated = rows[("", "Aggregated")]
    assert int(aggregated["Failure Count"]) == 0, (
        output + Path(f"{prefix}_failures.csv").read_text()
    )
    assert proc.returncode == 0, output  # Locust exits 1 when any request failed

    # Both user kinds, streaming and not, all did real work.
    for name in ("proxy chat", "proxy chat stream", "grpc", "grpc stream"):
        e2e = rows[("E2E", name)]
        assert int(e2e["Request Count"]) > 0, name
        assert float(e2e["Average Content Size"]) > 0, f"{name}: no completion tokens counted"
    for name in ("proxy chat stream", "grpc stream"):
        ttft, e2e = rows[("TTFT", name)], rows[("E2E", name)]
        assert int(ttft["Request Count"]) > 0, name
        # Each TTFT is at most its own request's E2E (averages cover different sets: requests
        # that ended without text have an E2E but no TTFT).
        assert float(ttft["Max Response Time"]) <= float(e2e["Max Response Time"])
    assert "generated tokens/s" in proc.stdout + proc.stderr


def _run_load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_load", ROOT / "benchmarks" / "run_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_run_load_sweep_writes_csvs_and_png(
    embedded_server: TritonServerProcess, proxy_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run_load.py"),
            "--host",
            proxy_url,
            "--users",
            "1,2",
            "--run-time",
            HANG_CAP,
            "--param",
            "steps=8",
            "--out",
            str(out),
        ],
        env=_load_env(embedded_server),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + _server_log(embedded_server)
    for users in (1, 2):
        assert (out / f"u{users:03d}_stats.csv").exists()
    rows = _run_load_module().read_stats(out / "u002_stats.csv", 2)
    total = next(r for r in rows if r.name == "all")
    assert total.requests > 0 and total.failures == 0 and total.tokens_per_s > 0
    with (out / "summary.csv").open(newline="") as fh:
        summary = list(csv.DictReader(fh))
    assert {int(r["users"]) for r in summary} == {1, 2}
    png = (out / "summary.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
