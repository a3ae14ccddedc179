"""The launcher's stub watch (what the supervisor restarts on) with real processes standing in
for tritonserver and its Python stubs: a stub that ends while the models load (Triton's
config auto-complete stub) is not a dead model; one that dies after the model is ready is."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm_triton.launch import launcher
from dlm_triton.launch.launcher import STUB_NAME, TritonServerProcess
from dlm_triton.launch.procs import alive, proc_children

# A parent that starts two processes whose argv[0] names the stub: one ends at once (the
# auto-complete stub), the other stays (the model instance's stub) until the parent is killed.
SERVER = f"""
import subprocess, sys, time
stub = ["/opt/backends/python/{STUB_NAME}", "-c", "import sys; sys.stdin.read()"]
short = subprocess.Popen(stub, executable=sys.executable, stdin=subprocess.PIPE)
long = subprocess.Popen(stub, executable=sys.executable, stdin=subprocess.PIPE)
print("started", flush=True)
sys.stdin.readline()  # the test says when the auto-complete stub may end
short.stdin.close(); short.wait()
print("short ended", flush=True)
time.sleep(120)
"""


def _stub_children(pid: int) -> list[int]:
    return [c for c in proc_children(pid) if alive(c)]


@pytest.fixture()
def server_process():
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "started"
        yield proc
    finally:
        children = proc_children(proc.pid)
        proc.kill()
        proc.wait(timeout=10)
        for child in children:  # the stand-in stubs read stdin: kill them by PID too
            subprocess.run(["kill", "-9", str(child)], check=False)


def test_a_stub_that_ends_during_loading_is_not_a_dead_model(
    server_process: subprocess.Popen, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = TritonServerProcess(model="tiny-dlm", device="cpu")
    server.server = server_process
    server.choice = launcher.ModelChoice(repository=tmp_path, name="tiny-dlm", env={})
    deadline = time.monotonic() + 10
    while len(_stub_children(server_process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # both stubs stay up until told (they read stdin)
    server._record_stubs()  # seen while loading: both stubs
    assert len(server._stubs) == 2
    server_process.stdin.write("go\n")
    server_process.stdin.flush()
    assert server_process.stdout.readline().strip() == "short ended"

    monkeypatch.setattr(launcher, "http_ok", lambda url, timeout=2.0: True)
    server._wait_ready()  # every model ready: the ended auto-complete stub is forgotten
    assert server.dead_reason() is None
    assert len(server.stub_pids()) == 1

    (instance,) = server.stub_pids()
    subprocess.run(["kill", "-9", str(instance)], check=True)
    deadline = time.monotonic() + 10
    while (reason := server.dead_reason()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reason == f"model stub {instance} died"
