"""Three real tritonservers behind one proxy, under streaming load, while one is SIGKILLed and
another gets SIGTERM (the way Kubernetes stops a pod), then the killed one comes back.

What must hold: no request that had not started streaming fails (the proxy moves it
to another replica), every started stream completes or ends with a clear error event, the load
spreads onto the restarted replica, and no process or /dev/shm file of ours is left behind.
Phases advance on counts of finished requests, never on timings.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from conftest import TEST_MODEL, requires_triton, start_server
from proxy_fixtures import ProxyProcess

from dlm_triton.launch.launcher import SHM_DIR, SHM_PREFIX, Ports, TritonServerProcess
from dlm_triton.launch.procs import alive, cmdline, http_ok, proc_children, spawn

pytestmark = requires_triton

MODEL = TEST_MODEL  # the session server is replica C: one start fewer
WORKERS = 3  # concurrent client streams: modest, the machine is small and shared
# Long enough that a kill lands mid-stream; tiny-test is a random 2-layer model.
REQUEST = {"max_tokens": 64, "steps": 64, "block_length": 16}
DRAIN_S = 60  # the SIGTERMed replica lets running streams finish for up to this long


@dataclass
class Outcome:
    """One streaming request as the client saw it."""

    started: bool  # at least one text chunk arrived
    finished: bool  # a finish_reason arrived (stop / length)
    error: str = ""


class Load:
    """WORKERS threads sending streaming completions through the proxy until stopped."""

    def __init__(self, proxy: ProxyProcess) -> None:
        self.client = proxy.client()
        self.outcomes: list[Outcome] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(WORKERS)
        self._futures = [self._pool.submit(self._worker, i) for i in range(WORKERS)]

    def _one(self, i: int) -> Outcome:
        started = finished = False
        try:
            stream = self.client.completions.create(
                model=MODEL, prompt=f"worker {i}", stream=True, extra_body=REQUEST
            )
            for chunk in stream:
                for choice in chunk.choices:
                    started = started or bool(choice.text)
                    finished = finished or choice.finish_reason in ("stop", "length")
            return Outcome(started, finished)
        except openai.APIError as exc:
            return Outcome(started, finished, f"{type(exc).__name__}: {exc}")

    def _worker(self, i: int) -> None:
        while not self._stop.is_set():
            outcome = self._one(i)
            with self._lock:
                self.outcomes.append(outcome)
                self._lock.notify_all()

    def wait_for(self, count: int, timeout: float = 120) -> None:
        """Until `count` more requests have finished (a cap that only catches hangs)."""
        with self._lock:
            target = len(self.outcomes) + count
            ok = self._lock.wait_for(lambda: len(self.outcomes) >= target, timeout)
        assert ok, f"only {len(self.outcomes)} of {target} requests finished"

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=120)  # a stream that never ends fails the test here
        self._pool.shutdown()
        return self.outcomes


def metric_lines(proxy: ProxyProcess) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(proxy.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^(dlm_proxy_replica_\w+)\{replica="([^"]+)"\} (\S+)$', text, re.M):
        out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def replica_value(proxy: ProxyProcess, name: str, url: str) -> float:
    return metric_lines(proxy).get((f"dlm_proxy_replica_{name}", url), 0.0)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class LauncherProcess:
    """`dlm-triton serve --no-proxy` as its own process, as in a pod: SIGTERM goes to it, and
    it drains and stops tritonserver. Records the processes and shm files it started."""

    def __init__(self, checkpoint: Path, log_path: Path) -> None:
        self.ports = Ports.free()
        self.grpc = f"127.0.0.1:{self.ports.grpc}"
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = spawn(  # dies with the test run, even a killed one
            [
                str(Path(sys.executable).with_name("dlm-triton")), "serve",
                "--model", str(checkpoint), "--model-name", MODEL, "--device", "cpu",
                "--no-proxy", "--host", "127.0.0.1", "--exit-timeout", "5",
                "--http-port", str(self.ports.http), "--grpc-port", str(self.ports.grpc),
                "--metrics-port", str(self.ports.metrics),
            ],
            env={**os.environ, "DLM_DRAIN_TIMEOUT": str(DRAIN_S)},
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.tree: dict[int, list[str]] = {}

    def wait_ready(self, timeout: float = 180) -> None:
        url = f"http://127.0.0.1:{self.ports.http}/v2/models/{MODEL}/ready"
        wait_until(lambda: http_ok(url) or self.proc.poll() is not None, timeout, "launcher")
        assert self.proc.poll() is None, "launcher exited while loading"
        self.record()

    def record(self) -> None:
        """tritonserver and its stubs (they must all be gone after the stop)."""
        for server in proc_children(self.proc.pid):
            self.tree[server] = cmdline(server)
            for stub in proc_children(server):
                self.tree[stub] = cmdline(stub)

    def leftovers(self) -> tuple[list[int], list[Path]]:
        pids = [p for p, cmd in self.tree.items() if alive(p) and cmdline(p) == cmd]
        names = {a.lstrip("/") for cmd in self.tree.values() for a in cmd if SHM_PREFIX in a}
        return pids, [SHM_DIR / n for n in names if (SHM_DIR / n).exists()]

    def kill_all(self) -> None:
        """Teardown after a failure only: our own PIDs, then our own shm files."""
        pids, files = self.leftovers()
        for pid in [self.proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for f in files:
            f.unlink(missing_ok=True)
        self._log.close()


def server_leftovers(server: TritonServerProcess) -> tuple[list[int], list[Path]]:
    return server.stub_pids(), server.shm_files()


@pytest.mark.timeout(420)
def test_load_survives_a_sigkill_and_a_sigterm_and_spreads_again(
    triton_server: TritonServerProcess, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    servers: list[TritonServerProcess] = []
    launcher: LauncherProcess | None = None
    proxy: ProxyProcess | None = None
    load: Load | None = None
    try:
        # A: started here (gets SIGKILL); B: its own launcher process (gets SIGTERM); C: the
        # session's server (stays up).
        launcher = LauncherProcess(tiny_checkpoint, tmp_path / "b.log")
        a = start_server(tiny_checkpoint, tmp_path, MODEL)
        servers.append(a)
        c = triton_server
        launcher.wait_ready()
        urls = {"a": a.urls["grpc"], "b": launcher.grpc, "c": c.urls["grpc"]}
        proxy = ProxyProcess(list(urls.values()), log_path=tmp_path / "proxy.log").start()
        wait_until(
            lambda: all(replica_value(proxy, "up", u) == 1 for u in urls.values()),
            30,
            "the proxy to see three replicas",
        )

        load = Load(proxy)
        load.wait_for(4)
        os.kill(a.server.pid, signal.SIGKILL)  # A crashes
        a_ports = a.ports
        load.wait_for(4)
        launcher.record()
        launcher.proc.send_signal(signal.SIGTERM)  # B is stopped as Kubernetes would
        load.wait_for(4)
        assert launcher.proc.wait(timeout=DRAIN_S + 60) == 0, "launcher drained and exited"
        load.wait_for(2)  # C alone
        # A comes back at the same address; the proxy must send it work again.
        a.stop()  # the launcher's clean-up after a crash: stubs and shm of the dead server
        assert server_leftovers(a) == ([], [])
        before = replica_value(proxy, "attempts_total", urls["a"])
        a2 = TritonServerProcess(
            tiny_checkpoint, model_name=MODEL, device="cpu", ports=a_ports,
            log_path=tmp_path / "a2.log", ready_timeout_s=180, exit_timeout_s=5,
        ).start()  # fmt: skip
        servers.append(a2)
        wait_until(lambda: replica_value(proxy, "up", urls["a"]) == 1, 60, "A back in the pool")
        load.wait_for(4)
        outcomes = load.stop()
        load = None
        after = replica_value(proxy, "attempts_total", urls["a"])
        stats = metric_lines(proxy)
        names = {u: k for k, u in urls.items()}
        summary = {
            "requests": len(outcomes),
            "completed": sum(o.finished for o in outcomes),
            "error_after_start": sum(bool(o.error) and o.started for o in outcomes),
            "a_after_restart": after - before,
            "per_replica": {
                names[url]: {
                    n.removeprefix("dlm_proxy_replica_"): v
                    for (n, u), v in stats.items()
                    if u == url
                }
                for url in urls.values()
            },
        }
        print(f"\nreplica test: {summary}")  # shown with -s; docs/deployment.md quotes a run

        not_started_failed = [o for o in outcomes if not o.started and not o.finished]
        assert not not_started_failed, f"requests failed before streaming: {not_started_failed}"
        for o in outcomes:
            assert o.finished or o.error, o  # completed, or ended with an error event
            if o.error:
                assert "Triton" in o.error or "unavailable" in o.error.lower(), o.error
        assert after > before, "the restarted replica gets requests again"
        # B was stopped the graceful way: none of its streams broke (its drain let them end).
        assert replica_value(proxy, "failures_total", urls["b"]) == 0
        assert replica_value(proxy, "failures_total", urls["c"]) == 0
        assert replica_value(proxy, "attempts_total", urls["c"]) > 0
    finally:
        if load is not None:
            load.stop()
        if proxy is not None:
            assert proxy.stop() == 0
        for s in servers:
            s.stop()
        if launcher is not None:
            if launcher.proc.poll() is None:
                launcher.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    launcher.proc.wait(timeout=DRAIN_S + 30)
            left = launcher.leftovers()
            launcher.kill_all()
            assert left == ([], []), f"launcher left behind {left}"
    for s in servers:
        assert server_leftovers(s) == ([], []), s.last_stop


def test_dns_entry_serves_through_every_resolved_address(
    triton_server: TritonServerProcess, tmp_path: Path
) -> None:
    """`dns:localhost:PORT` (how the proxy follows a headless Service): each address localhost
    resolves to is a replica; the one where Triton listens serves, any other stays out."""
    port = triton_server.urls["grpc"].rsplit(":", 1)[1]
    proxy = ProxyProcess([f"dns:localhost:{port}"], log_path=tmp_path / "proxy.log").start()
    try:
        ipv4 = f"127.0.0.1:{port}"
        wait_until(lambda: replica_value(proxy, "up", ipv4) == 1, 30, "the resolved replica")
        r = proxy.client().completions.create(model=MODEL, prompt="hello", max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert replica_value(proxy, "attempts_total", ipv4) == 1
        others = {u for (_, u) in metric_lines(proxy)} - {ipv4}
        assert all(replica_value(proxy, "up", u) == 0 for u in others)  # e.g. [::1]: no server
    finally:
        assert proxy.stop() == 0
