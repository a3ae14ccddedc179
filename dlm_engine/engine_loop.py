"""The engine on its own thread, for servers: submit from any thread, outputs by callback.

Requests join between steps; cancellations take effect before the next step; a failing step
fails only the requests it was running, never the loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import ResolvedParams
from .threads import use_threads

log = logging.getLogger(__name__)
OnOutput = Callable[[RequestOutput], None]


class EngineLoop:
    """Runs `engine.step()` in a daemon thread while there is work."""

    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[int], None] | None = None,
        torch_threads: int | None = None,
    ) -> None:
        self.engine = engine
        self.on_step = on_step  # rows per step, for metrics
        self.torch_threads = torch_threads  # set on the loop's thread (dlm_engine/threads.py)
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._callbacks: dict[str, OnOutput] = {}
        self._stop = threading.Event()
        self._pending_adds = 0  # submitted, not yet handed to the engine (cancels not counted)
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="dlm-engine", daemon=True)
        self._thread.start()

    def submit(
        self, request_id: str, prompt_ids: list[int], params: ResolvedParams, on_output: OnOutput
    ) -> None:
        with self._pending_lock:
            self._pending_adds += 1
        self._inbox.put(("add", request_id, prompt_ids, params, on_output))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a row: in the engine's queue or not yet handed to it."""
        return self.engine.num_waiting + self._pending_adds

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop after the current step; unfinished requests get a final `abort` output."""
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)
        # a tensor-parallel model's worker ranks stop with the loop (by PID, reaped)
        close = getattr(getattr(self.engine.runner, "model", None), "close", None)
        if close is not None and not self._thread.is_alive():
            close()

    def _run(self) -> None:
        use_threads(self.torch_threads)
        device = self.engine.loaded.device
        if device.type == "cuda":
            # the current device is per thread: make this thread's the engine's GPU, so that
            # streams, events and graphs made without a device land on it (a data-parallel
            # replica runs on cuda:1 while every thread starts on cuda:0)
            torch.cuda.set_device(device)
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_unfinished())
            if self.engine.scheduler.opens_phase():
                self._gather_burst()
            if self._stop.is_set():
                break
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step fails its rows, not the server
                log.exception("engine step failed")
                self._fail_running(f"internal error: {exc}")
                continue
            if self.on_step is not None and self.engine.last_step_rows:
                self.on_step(self.engine.last_step_rows)
            for out in outputs:
                self._deliver(out)
        self._abort_all()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _gather_burst(self) -> None:
        """Before cached rows start their block phase, take the requests still arriving (until
        none came for the admission gap, the longer burst gap once a second request came, at
        most the admission window, or until the waiting rows fill a step), so a burst's rows
        start together (EngineConfig.admission_window_ms says why)."""
        config = self.engine.config
        window, gap = config.admission_window_ms / 1e3, config.admission_gap_ms / 1e3
        if window <= 0 or gap <= 0:
            return
        burst_gap = max(gap, config.admission_burst_gap_ms / 1e3)
        deadline = time.monotonic() + window
        arrivals = len(self.engine.scheduler.waiting)
        while not self._stop.is_set() and not self.engine.scheduler.waiting_fill_a_step():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                item = self._inbox.get(timeout=min(gap if arrivals < 2 else burst_gap, left))
            except queue.Empty:
                return
            self._handle(item)
            arrivals += item[0] == "add"

    def _handle(self, item: tuple) -> None:
        if item[0] == "add":
            _, rid, prompt_ids, params, cb = item
            with self._pending_lock:
                self._pending_adds -= 1
            try:
                self.engine.add_request(rid, prompt_ids, params)
                self._callbacks[rid] = cb
            except Exception as exc:
                cb(_error_output(rid, str(exc), len(prompt_ids)))
        elif item[0] == "cancel" and item[1] in self._callbacks:
            self.engine.abort(item[1])

    def _deliver(self, out: RequestOutput) -> None:
        cb = self._callbacks.get(out.request_id)
        if out.finished:
            self._callbacks.pop(out.request_id, None)
        if cb is None:
            return
        try:
            cb(out)
        except Exception:
            log.exception("output callback failed for %s", out.request_id)

    def _fail_running(self, message: str) -> None:
        for rid, prompt_tokens in self.engine.drop_running():
            cb = self._callbacks.pop(rid, None)
            if cb is not None:
                cb(_error_output(rid, message, prompt_tokens))

    def _abort_all(self) -> None:
        for rid in list(self._callbacks):
            self.engine.abort(rid)
        for out in self.engine.drain_aborted():
            self._deliver(out)
        for rid, cb in list(self._callbacks.items()):
            cb(_error_output(rid, "internal error: server shutting down", 0))
        self._callbacks.clear()


def _error_output(request_id: str, message: str, prompt_tokens: int) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        text="",
        delta_text="",
        token_ids=[],
        finished=True,
        finish_reason="error",
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        steps=0,
        error=message,
    )
