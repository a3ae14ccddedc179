"""Stopping leaves nothing behind: no tritonserver, no Python stub, no /dev/shm region.

Triton 2.51 can hang on SIGTERM after HTTP stream clients disconnect and its stubs ignore
SIGTERM, so these tests stop servers in exactly that state: requests still generating, one
HTTP stream dropped mid-way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from dlm_client import DLMClient, DLMError

from dlm_triton.launch.launcher import SHM_DIR, SHM_PREFIX, STUB_NAME
from dlm_triton.launch.procs import free_ports

pytestmark = pytest.mark.integration
LONG = {"max_tokens": 1024, "steps": 1024, "stream_mode": "denoise", "suppress_eos": True}


def _stubs_with(fragment: str) -> dict[int, list[str]]:
    """Live stub processes whose command line mentions ``fragment``."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args and args[0].endswith(STUB_NAME) and any(fragment in a for a in args):
            found[int(proc.name)] = args
    return found


def _shm_names(stubs: dict[int, list[str]]) -> set[str]:
    return {a for args in stubs.values() for a in args if a.startswith(SHM_PREFIX)}


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.fixture(scope="module")
def dream_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    testing = pytest.importorskip("dlm_lab.testing")
    return testing.make_tiny_checkpoint(tmp_path_factory.mktemp("dream") / "tiny-dream", "dream")


def test_stop_while_generating_leaves_nothing_behind(server_factory, dream_checkpoint) -> None:
    # A short drain: the requests are still running when it ends, so they are aborted.
    server = server_factory(
        dream_checkpoint, name=f"dream-{uuid.uuid4().hex[:8]}", drain_timeout_s=0.5
    )
    stubs = dict(_stubs_with(f"/{server.model_name}/1/model.py"))
    assert stubs, "no stub process found for the model"
    shm = _shm_names(stubs)
    assert shm and all((SHM_DIR / n).exists() for n in shm)

    client = DLMClient(server.urls["grpc"], server.model_name, http_url=server.urls["http"])
    first_chunk = threading.Barrier(3 + 1, timeout=120)
    ended: list[str] = []

    def grpc_user(i: int) -> None:
        try:
            chunks = client.stream(f"prompt {i}", **LONG)
            next(chunks)
            first_chunk.wait()
            ended.append([c.finish_reason for c in chunks][-1])
        except DLMError as exc:
            ended.append(f"error: {exc}")

    threads = [threading.Thread(target=grpc_user, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # An HTTP stream client that disconnects mid-generation (the 2.51 shutdown hazard).
    body = {
        "text_input": "bye",
        "stream": True,
        "sampling_parameters": json.dumps(LONG),
    }
    with httpx.stream("POST", server.urls["generate_stream"], json=body, timeout=60) as r:
        next(r.iter_lines())
    first_chunk.wait()

    pid = server.server.pid
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 60
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a client never saw its stream end"
    # The launcher's drain handshake: running requests end with a final "abort" response and
    # Triton exits by itself (no SIGKILL) although an HTTP stream was dropped.
    assert ended == ["abort"] * 3, ended
    assert server.last_stop["drained"] and server.last_stop["server_exit"] == 0, server.last_stop
    assert _gone(pid)
    assert all(_gone(p) for p in stubs), "a stub outlived its server"
    assert not [n for n in shm if (SHM_DIR / n).exists()], "shm regions left in /dev/shm"


def test_cli_serve_stops_cleanly_on_sigterm(tiny_checkpoint: Path, tmp_path: Path) -> None:
    name = f"cli-{uuid.uuid4().hex[:8]}"
    http, grpc, metrics = free_ports(3)
    cmd = [
        sys.executable, "-m", "dlm_triton.launch.cli", "serve", "--model", str(tiny_checkpoint),
        "--model-name", name, "--device", "cpu", "--no-proxy", "--exit-timeout", "5",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        "--log-file", str(tmp_path / "triton.log"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            if line.startswith("ready:") or time.monotonic() > deadline:
                break
        assert proc.poll() is None, "serve exited early"
        stubs = _stubs_with(f"/{name}/1/model.py")
        shm = _shm_names(stubs)
        assert stubs and shm
        out = subprocess.run(
            [sys.executable, "-m", "dlm_triton.launch.cli", "generate", "Hi", "--model", name,
             "--url", f"127.0.0.1:{grpc}", "--max-tokens", "8", "--steps", "4", "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert '"finish_reason"' in out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:  # a failed assertion: let the launcher clean up, then force
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert all(_gone(p) for p in stubs)
    assert not [n for n in shm if (SHM_DIR / n).exists()]
    assert not os.path.exists(f"/proc/{proc.pid}")


def test_launcher_starts_the_openai_proxy_in_front(server_factory, tiny_checkpoint: Path) -> None:
    pytest.importorskip("openai_proxy.__main__")
    server = server_factory(tiny_checkpoint, name="tiny-proxied", proxy=True)
    assert "openai" in server.urls
    body = {
        "model": "tiny-proxied",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
    r = httpx.post(f"{server.urls['openai']}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    proxy_pid = server.proxy.pid
    server.stop()
    assert _gone(proxy_pid) and server.last_stop["stubs_killed"] == 0


def test_cli_serve_sigterm_while_loading_cleans_up(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """``docker stop`` during a (long) model load: the launcher must not die by the signal and
    orphan tritonserver; it aborts the start and stops what it began."""
    name = f"load-{uuid.uuid4().hex[:8]}"
    http, grpc, metrics = free_ports(3)
    cmd = [
        sys.executable, "-m", "dlm_triton.launch.cli", "serve", "--model", str(tiny_checkpoint),
        "--model-name", name, "--device", "cpu", "--no-proxy", "--exit-timeout", "5",
        "--http-port", str(http), "--grpc-port", str(grpc),
        "--metrics-port", str(metrics), "--log-file", str(tmp_path / "triton.log"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (stubs := _stubs_with(f"/{name}/1/model.py")):
            assert proc.poll() is None and time.monotonic() < deadline, "no stub started"
            time.sleep(0.05)
        shm = _shm_names(stubs)
        proc.send_signal(signal.SIGTERM)  # the model is loading (or just ready)
        assert proc.wait(timeout=90) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in stubs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in stubs)
    assert not [n for n in shm if (SHM_DIR / n).exists()]
