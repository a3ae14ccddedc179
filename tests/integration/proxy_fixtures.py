"""The OpenAI proxy as a real subprocess (`python -m openai_proxy`) for integration tests.

Test modules import the fixtures they use from here; the Triton side comes from the shared
conftest (`triton_server`, `server_factory`, `read_metric`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest

from dlm_triton.launch import admin_key
from dlm_triton.launch.launcher import TritonServerProcess, free_port
from dlm_triton.launch.procs import spawn

ROOT = Path(__file__).resolve().parents[2]


def _admin_key_args() -> list[str]:
    """The launcher restricts Triton's admin APIs; the proxy's health probe needs the key."""
    path = admin_key.default_key_file()
    return ["--triton-admin-key-file", str(path)] if path.exists() else []


class ProxyProcess:
    """One proxy process on a free port; stopped by PID (SIGTERM, bounded wait, SIGKILL)."""

    def __init__(
        self, triton_grpc: Sequence[str], args: Sequence[str] = (), log_path: Path | None = None
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "openai_proxy",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--health-interval", "0.5",
            "--health-timeout", "1",
            "--log-level", "warning",
            *[a for url in triton_grpc for a in ("--triton-url", url)],
            *_admin_key_args(),
            *args,
        ]  # fmt: skip
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout_s: float = 30.0) -> ProxyProcess:
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = spawn(  # dies with the test run, even a killed one
            self.cmd,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health/live", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"proxy did not start in {timeout_s}s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def terminate(self) -> None:
        """SIGTERM only: the proxy drains running requests, then exits."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        code = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def client(self, api_key: str = "unused", **kw: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=180, **kw
        )

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=180
        )


@pytest.fixture(scope="session")
def proxy(
    triton_server: TritonServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    """The shared proxy (auth off) in front of the session tritonserver."""
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    p = ProxyProcess([triton_server.urls["grpc"]], log_path=log).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture()
def oai(proxy: ProxyProcess) -> openai.OpenAI:
    return proxy.client()


@pytest.fixture()
def model(triton_server: TritonServerProcess) -> str:
    return triton_server.model_name
