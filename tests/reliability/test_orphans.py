"""Nothing outlives its parent: a test run, benchmark or launcher killed by a time limit (SIGTERM
or SIGKILL, no teardown) leaves no tritonserver, Python stub or OpenAI proxy behind.

Children are started with a parent-death signal (`dlm_triton.launch.procs.spawn`), also when the
thread that asked for them has ended (the supervisor's restarts); the stubs, which tritonserver
starts, end themselves once tritonserver is gone (`orphan.exit_when_orphaned`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_stack import MODEL, require_triton

from dlm_lab.testing import make_tiny_checkpoint
from dlm_triton.launch.launcher import Ports, TritonServerProcess
from dlm_triton.launch.procs import alive

GONE_WITHIN_S = 30.0  # tritonserver's own SIGTERM exit (exit timeout 5 s) on a busy machine

# The parent: starts the stack (server from a thread that then ends, as the supervisor's
# restarts do), prints every child's PID, then waits to be killed.
PARENT = """
import json, sys, threading, time
from pathlib import Path
from dlm_triton.launch.launcher import Ports, TritonServerProcess
server = TritonServerProcess(
    Path(sys.argv[1]), model_name=sys.argv[2], device="cpu", ports=Ports.free(), proxy=True,
    log_path=Path(sys.argv[3]), ready_timeout_s=180, exit_timeout_s=5,
)
t = threading.Thread(target=server.start)
t.start()
t.join()
time.sleep(1.0)  # the starting thread has ended: the children must still be there
assert server.server.poll() is None and server.proxy.poll() is None
pids = {"server": server.server.pid, "proxy": server.proxy.pid, "stubs": server.stub_pids()}
print(json.dumps(pids), flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_triton()
    return make_tiny_checkpoint(tmp_path_factory.mktemp("orphans") / "ckpt", "llada", seed=3)


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_children_die_with_a_killed_parent(checkpoint: Path, tmp_path: Path, sig) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(checkpoint), MODEL, str(tmp_path / "triton.log")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # like `make test`'s own group: the signal reaches it alone
    )
    children: list[int] = []
    try:
        line = parent.stdout.readline()
        assert line, f"the parent died before its stack was up (rc {parent.wait()})"
        pids = json.loads(line)
        children = [pids["server"], pids["proxy"], *pids["stubs"]]
        assert pids["stubs"] and all(alive(p) for p in children)
        os.kill(parent.pid, sig)
        parent.wait(timeout=30)
        left = _wait_gone(children, GONE_WITHIN_S)
        assert not left, f"outlived their parent: {left}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        _kill_all(children)


def test_stubs_die_with_a_killed_tritonserver(checkpoint: Path, tmp_path: Path) -> None:
    server = TritonServerProcess(
        checkpoint, model_name=MODEL, device="cpu", ports=Ports.free(),
        log_path=tmp_path / "triton.log", ready_timeout_s=180, exit_timeout_s=5,
    ).start()  # fmt: skip
    stubs = server.stub_pids()
    try:
        assert stubs
        os.kill(server.server.pid, signal.SIGKILL)
        server.server.wait(timeout=30)
        left = _wait_gone(stubs, 10.0)
        assert not left, f"stubs outlived tritonserver: {left}"
    finally:
        _kill_all(stubs)
        server.stop()
