"""A silent upstream never hangs a client: the proxy's stream inactivity timeout.

The stub is frozen with SIGSTOP (alive, so the supervisor leaves it alone; Triton sends
nothing): a streaming call through a proxy with ``--stream-idle-timeout 3`` ends with an
error event or a 504 within seconds, then SIGCONT and the stack answers again.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from reliability_stack import ExtraProxy, chat_body, metric_value, proxy_stream

from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

IDLE_S = 3
LONG = {"max_tokens": 1024, "steps": 1024, "block_length": 32, "suppress_eos": True}


def test_silent_upstream_ends_the_stream(stack: TritonServerProcess) -> None:
    with (
        ExtraProxy(stack, "--stream-idle-timeout", str(IDLE_S)) as proxy,
        ThreadPoolExecutor(1) as pool,
    ):
        assert proxy_stream(proxy.base_url, chat_body()).done  # healthy first
        stub = stack.stub_pids()[0]
        call = pool.submit(proxy_stream, proxy.base_url, chat_body(**LONG), 120)
        deadline = time.monotonic() + 30
        while metric_value(stack, "dlm_requests_in_flight") < 1:  # in the engine now
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(stub, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            out = call.result(timeout=IDLE_S + 30)
        finally:
            os.kill(stub, signal.SIGCONT)
        assert not out.done and out.error and "sent nothing" in out.error, out
        assert out.status in (200, 504) and out.ended_at - frozen_at < IDLE_S + 20, out
        # afterwards the stack answers again (Triton may have given up on the stub, in which
        # case the supervisor restarts the server)
        deadline = time.monotonic() + 180
        while not proxy_stream(proxy.base_url, chat_body()).done:
            assert time.monotonic() < deadline, "not answering after SIGCONT"
            time.sleep(0.5)
