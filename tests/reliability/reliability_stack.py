"""The served stack for reliability tests: tritonserver (supervised) + the OpenAI proxy, started
by the launcher on free ports with a tiny random LLaDA checkpoint, and small client helpers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from dlm_triton.launch.launcher import Ports, TritonServerProcess
from dlm_triton.launch.procs import spawn
from dlm_triton.launch.server_dist import TritonNotFoundError, find_server

MODEL = "tiny-rel"
LONG_ENV = "DLM_RELIABILITY_LONG"  # set to 1 for the long variants (docs/reliability.md)


def long_runs() -> bool:
    return os.environ.get(LONG_ENV, "") not in ("", "0")


def require_triton() -> None:
    try:
        find_server()
    except TritonNotFoundError:
        pytest.skip("no tritonserver available")


def start_stack(checkpoint: Path, log_dir: Path, **kw) -> TritonServerProcess:
    """tritonserver + proxy on free ports; the caller stops it."""
    server = TritonServerProcess(
        checkpoint,
        model_name=MODEL,
        device="cpu",
        ports=Ports.free(),
        proxy=True,
        log_path=log_dir / f"{MODEL}-triton.log",
        ready_timeout_s=180,
        exit_timeout_s=5,
        **kw,
    )
    return server.start()


def chat_body(content: str = "What is 2+2?", **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    body.update(extra)
    return body


@dataclass
class StreamOutcome:
    """How one streaming call ended."""

    status: int = 0
    retry_after: str | None = None
    error: str | None = None  # the SSE error event's message, or the transport error
    done: bool = False  # saw [DONE] after a normal finish
    ended_at: float = 0.0
    chunks: int = 0
    events: list[dict] = field(default_factory=list)


def proxy_stream(base: str, body: dict, timeout_s: float = 120.0) -> StreamOutcome:
    """One streaming chat completion through the proxy, recorded however it ends."""
    out = StreamOutcome()
    try:
        with (
            httpx.Client(timeout=timeout_s) as http,
            http.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}) as r,
        ):
            out.status = r.status_code
            out.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                out.error = r.read().decode(errors="replace")
            else:
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        out.done = out.error is None
                        break
                    event = json.loads(data)
                    if "error" in event:
                        out.error = str(event["error"].get("message"))
                        out.events.append(event)
                    else:
                        out.chunks += 1
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.ended_at = time.monotonic()
    return out


def status_of(url: str, timeout_s: float = 2.0) -> int:
    """HTTP status of a GET, 0 when nothing answers."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError:
        return 0


def metric_value(server: TritonServerProcess, name: str) -> float:
    """Sum of a metric's samples on the server's metrics port (0 when absent)."""
    text = httpx.get(server.urls["metrics"], timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class ExtraProxy:
    """One more proxy process in front of the stack's Triton (own flags); stopped by PID."""

    def __init__(self, server: TritonServerProcess, *args: str, with_key: bool = True) -> None:
        from dlm_triton.launch.launcher import free_port

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        key_file = server.admin_key_file if with_key else None
        key = ["--triton-admin-key-file", str(key_file)] if key_file else []
        self.cmd = [
            sys.executable, "-m", "openai_proxy",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--triton-url", server.urls["grpc"], "--model", MODEL,
            "--health-interval", "0.5", "--log-level", "warning", *key, *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ExtraProxy:
        self.proc = spawn(self.cmd, start_new_session=True)  # dies with the test run
        deadline = time.monotonic() + 60
        while status_of(self.base_url + "/health") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("the extra proxy did not become healthy")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
