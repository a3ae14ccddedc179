"""SIGTERM of an idle `dlm-triton serve` (tiny-dlm with its companion tiny-sdar, as
`make serve`): both models finalize and unload, and tritonserver exits by itself within its
exit timeout (exit 0, no SIGKILL from the launcher)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm_triton.launch.procs import alive, free_ports
from dlm_triton.launch.server_dist import TritonNotFoundError, find_server

pytestmark = pytest.mark.integration
EXIT_TIMEOUT_S = 10
MODELS = ("tiny-dlm", "tiny-sdar")


def test_idle_serve_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    try:
        find_server()
    except TritonNotFoundError:
        pytest.skip("no tritonserver available")
    http, grpc, metrics = free_ports(3)
    log, err = tmp_path / "triton.log", tmp_path / "serve.err"
    cmd = [
        sys.executable, "-m", "dlm_triton.launch.cli", "serve", "--device", "cpu", "--no-proxy",
        "--exit-timeout", str(EXIT_TIMEOUT_S), "--http-port", str(http),
        "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--log-file", str(log),
    ]  # fmt: skip
    with err.open("w") as err_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True)
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.startswith("ready:") or time.monotonic() > deadline:
                break
        assert proc.poll() is None, f"serve exited early: {err.read_text()[-2000:]}"
        server_pids = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
                       .read_text().split()]  # fmt: skip
        time.sleep(1.0)  # idle
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=EXIT_TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running after SIGTERM: {err.read_text()[-3000:]}")
        assert code == 0, err.read_text()[-2000:]
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    stopped = next(
        json.loads(line.removeprefix("stopped: "))
        for line in err.read_text().splitlines()
        if line.startswith("stopped: ")
    )
    # Triton exited by itself (exit 1 would mean its exit timeout expired); nothing was killed
    assert stopped["server_exit"] == 0 and not stopped["server_killed"], stopped
    assert stopped["stubs_killed"] == 0, stopped
    text = log.read_text()
    for name in MODELS:
        assert f"dlm model {name}: finalized in" in text, name
        assert f"successfully unloaded '{name}'" in text, name
    assert took < EXIT_TIMEOUT_S + 10, took  # the drain of an idle stack is immediate
    assert not [p for p in server_pids if alive(p)]
