"""The one Triton adapter: ``TritonPythonModel`` for every model in ``model_repository/``.

Decoupled, in the manner of Triton's vllm_backend: ``execute()`` validates each request, hands
it to the engine thread (``dlm_engine.EngineLoop``) and returns ``None``. Engine outputs go to a
queue; a sender thread turns them into responses (each ``send()`` is a round trip to
tritonserver, too slow for the engine thread). A watcher thread turns client cancellations into
``EngineLoop.cancel``. Every request ends with exactly one
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``: on success, error, cancel and shutdown.

An engine that can serve no request any more (a tensor-parallel worker rank exited) is a dead
model, not a model that fails every request: the watcher sees it (``Engine.fault``), ends the
requests in flight with the reason, stops the remaining ranks and exits the stub, which is
how Triton and the launcher's supervisor see a dead model (not ready; the supervisor restarts
the server, and with it the whole group).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlm_protocol import tensors
from dlm_protocol.errors import ERROR_PREFIXES, PREFIX_INTERNAL
from dlm_triton.backend.intake import Intake
from dlm_triton.backend.metrics import Metrics
from dlm_triton.backend.request_parse import RequestError, parse_request
from dlm_triton.backend.settings import config_parameters, resolve_settings
from dlm_triton.backend.step_metrics import (
    CATCH_UP_S,
    STEP_METRICS_EVERY_S,
    StepFigures,
    StepMetrics,
)
from dlm_triton.instance_load import LoadBoard, board_dir

if TYPE_CHECKING:
    from dlm_engine.outputs import RequestOutput

try:  # only importable inside the Python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - docs, linters, unit tests
    pb_utils = None

INPUT_NAMES = tuple(t.name for t in tensors.INPUTS)
# Each request's is_cancelled() is a round trip to tritonserver, paid beside the steps: every
# 50 ms, a cancelled row leaves the batch within a few steps.
WATCH_INTERVAL_S = 0.05
DRAIN_TIMEOUT_S = float(os.environ.get("DLM_DRAIN_TIMEOUT", "5"))  # launcher: exit timeout / 2
# Written by the launcher before it stops tritonserver: drain now (see launcher._drain).
DRAIN_FILE = os.environ.get("DLM_DRAIN_FILE")
DRAIN_POLL_EVERY = 4  # watcher ticks (0.2 s)
FAULT_POLL_EVERY = 10  # watcher ticks (0.5 s) between checks that the engine can still serve
FAULT_EXIT_STATUS = 70  # the stub's exit status when its engine can serve no more


@dataclass
class _Live:
    """A request between ``execute()`` and its final response."""

    rid: str
    request: Any
    sender: Any
    stream: bool
    t0: float
    work: int = 0  # estimated token-forwards (steps x (prompt + answer tokens))
    first_text_at: float | None = None  # set by the engine thread for a non-streamed request
    ttft_recorded: bool = False
    cancel_requested: bool = False  # the client cancelled or went away
    abort_sent: bool = False  # we aborted it (drain timeout)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    # a non-streamed request's logprob entries, gathered for its one response
    logprobs: list[dict[str, Any]] = field(default_factory=list)


def _output_tensor(spec: tensors.TensorSpec, value: Any) -> Any:
    """One ``[1, 1]`` output of the contract's datatype (BYTES as UTF-8)."""
    value = str(value or "").encode("utf-8") if spec.datatype == "BYTES" else value or 0
    return pb_utils.Tensor(spec.name, np.array([[value]], dtype=spec.numpy_dtype))


def _load_board(model_config: dict[str, Any], model_name: str) -> LoadBoard | None:
    """This instance's place on the model's load board, when the model can have several
    instances (KIND_GPU places one on each listed or visible GPU); None for a lone one."""
    groups = model_config.get("instance_group") or []
    instances = sum(int(g.get("count") or 1) * max(1, len(g.get("gpus") or [])) for g in groups)
    gpu_wide = any(g.get("kind") == "KIND_GPU" and not g.get("gpus") for g in groups)
    if instances <= 1 and not gpu_wide:
        return None
    return LoadBoard(board_dir(model_name, os.getppid()))


class TritonPythonModel:
    """Maps Triton requests to engine requests and engine outputs to (streamed) responses."""

    # ------------------------------------------------------------------ lifecycle
    def initialize(self, args: dict[str, str]) -> None:
        from dlm_engine import Engine, EngineConfig, EngineLoop
        from dlm_engine.models.common import FusedKernels
        from dlm_engine.threads import engine_threads, hand_threads_to_engine_thread
        from dlm_triton.backend.orphan import exit_when_orphaned

        # tritonserver starts this stub and cannot make it die with it: a tritonserver that
        # died (SIGKILL, crash) must not leave the stub and its model running
        exit_when_orphaned()
        model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        model_dir = Path(args.get("model_repository", ".")).resolve()
        self.settings = resolve_settings(
            config_parameters(model_config),
            kind=args.get("model_instance_kind", "CPU"),
            device_id=int(args.get("model_instance_device_id") or 0),
            model_dir=model_dir.parent if model_dir.name.isdigit() else model_dir,
        )
        s = self.settings
        # the main thread stays single-threaded; the engine thread steps with the process's
        # threads on the CPU, a few on a GPU (engine_threads)
        process_threads = hand_threads_to_engine_thread()
        self.engine = Engine(EngineConfig(**s.values))
        self.torch_threads = engine_threads(
            self.engine.config.engine_threads, process_threads, self.engine.loaded.device
        )
        # before the model reports ready: kernels compiled, first graphs captured (CUDA)
        warmup_s = self.engine.warm_up() if s.warmup else None
        self.instance_name = args.get("model_instance_name", "0")
        self.metrics = Metrics(pb_utils, self.model_name, self.instance_name)
        # the launcher counts restarts across server lives and hands the count to each one
        self.metrics.restarts.increment(int(os.environ.get("DLM_RESTARTS") or 0))

        self._live: dict[str, _Live] = {}
        self._live_lock = threading.Lock()
        self._work = 0  # the live requests' work estimates summed (under _live_lock)
        self._ids = itertools.count()
        self._outbox: queue.Queue = queue.Queue()
        self._closing = False
        self._stop = threading.Event()
        self.loop = EngineLoop(self.engine, on_step=self._on_step, torch_threads=self.torch_threads)
        self.step_metrics = StepMetrics(
            self.metrics,
            in_flight=lambda: len(self._live),
            queue_depth=lambda: self.loop.queue_depth,
            fused_fallbacks=lambda: len(FusedKernels.fallbacks),
            graph_captures=lambda: self.engine.runner.graph_captures,
        )
        self._intake = Intake()
        # several instances of this model (one per GPU): new requests go to the least busy
        self._board = _load_board(model_config, self.model_name)
        self._sender = threading.Thread(target=self._send_loop, name="dlm-sender", daemon=True)
        self._watcher = threading.Thread(target=self._watch_loop, name="dlm-watch", daemon=True)
        self._sender.start()
        self._watcher.start()
        from dlm_engine.quantization import weight_bytes

        loaded = self.engine.loaded  # the loader's own choice, not a second derivation
        dtype, why = str(loaded.dtype).removeprefix("torch."), loaded.dtype_reason
        self.metrics.info(
            dtype=dtype,
            dtype_reason=why,
            device=s.device,
            torch_threads=str(self.torch_threads),
            quantization=s.quantization or "none",
            weight_bytes=str(weight_bytes(loaded.model)),
            **self._kv_pool_labels(),
        )
        pb_utils.Logger.log_info(
            f"dlm model {self.model_name}: checkpoint={s.model} device={s.device} "
            f"dtype={dtype} ({why}) max_rows={s.max_rows} torch_threads={self.torch_threads} (engine thread)"
            + ("" if warmup_s is None else f" warm-up={warmup_s:.1f}s")
        )
        # What is loaded now lives as long as the process: frozen, it is out of the cyclic
        # collector's sight, so a full collection does not walk the model's objects (hundreds
        # of thousands even for tiny-dlm, holding the GIL the engine thread needs).
        gc.freeze()
        self.metrics.gc_frozen_objects.set(gc.get_freeze_count())

    def _on_step(self, rows: int) -> None:
        """EngineLoop hook, on the engine thread after every step that ran rows: its figures
        are kept for the sender thread to record off the responses' path (``step_metrics``)."""
        cache = self.engine.runner.prefix_cache
        tokens = None if cache is None else (cache.lookup_tokens, cache.hit_tokens)
        self.step_metrics.add(StepFigures(rows, self.engine.last_step_seconds, tokens))

    def _on_output(self, live: _Live, out: RequestOutput) -> None:
        """Engine thread. A streamed request's outputs, every final one and every error go to
        the sender; a non-streamed request's others only leave their first-text time and
        logprobs here, so a lone request's steps never wake the sender thread."""
        if live.stream or out.finished or out.error:
            self._outbox.put((live, out))
            return
        if out.delta_text and live.first_text_at is None:
            live.first_text_at = time.monotonic()
        if out.logprobs:
            live.logprobs.extend(out.logprobs)

    def finalize(self) -> None:
        """Stop accepting, let running requests finish for a bounded time, abort the rest,
        and end every request still open with a final response."""
        self._closing = True
        started = time.monotonic()
        self._intake.shutdown()  # large requests being parsed end (refused) before the drain
        pb_utils.Logger.log_info(
            f"dlm model {self.model_name}: finalize, {len(self._live)} in flight"
        )
        deadline = started + DRAIN_TIMEOUT_S
        while self._live and time.monotonic() < deadline:
            time.sleep(0.05)
        for live in list(self._live.values()):
            self.loop.cancel(live.rid)
        # everything after the drain shares one budget: the launcher sets DRAIN_TIMEOUT_S to
        # half of Triton's exit timeout, so finalize ends (at 1.8x) before Triton gives up
        end = started + 1.8 * DRAIN_TIMEOUT_S

        def left(cap: float) -> float:
            return max(0.1, min(cap, end - time.monotonic()))

        deadline = time.monotonic() + left(2.0)
        while self._live and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            self.loop.shutdown(timeout=left(5.0))
        except Exception as exc:  # finalize must finish every request anyway
            pb_utils.Logger.log_warn(f"engine loop shutdown: {exc}")
        self._outbox.put(None)
        self._sender.join(timeout=left(5.0))
        self._stop.set()
        for live in list(self._live.values()):
            self._fail(live, "internal error: the model was unloaded before the request finished")
        if self._board is not None:
            self._board.close()
        pb_utils.Logger.log_info(
            f"dlm model {self.model_name}: finalized in {time.monotonic() - started:.2f}s"
        )

    # ------------------------------------------------------------------ requests
    def _kv_pool_labels(self) -> dict[str, str]:
        """Block-diffusion models: the KV page pool's size and the prefix cache's idle cap, in
        tokens, as the engine sized them (from free GPU memory, or the configured tokens)."""
        pages = getattr(self.engine.runner, "block_pages", None)
        if pages is None:
            return {}
        pool = pages.pool
        return {
            "kv_pool_tokens": str(pool.pages * pool.page_tokens),
            "kv_page_tokens": str(pool.page_tokens),
            "prefix_cache": "on" if pages.cache is not None else "off",
        }

    def execute(self, requests: list) -> None:
        for request in requests:
            t0 = time.monotonic()
            try:
                inputs = self._inputs(request)
            except Exception as exc:  # any failure must still end the request
                self._reject(request.get_response_sender(), f"internal error: {exc}", "error")
                continue
            # a large prompt is parsed and tokenized on a worker, never before small ones
            self._intake.accept(inputs, lambda r=request, i=inputs, t=t0: self._accept(r, i, t))
        if self._board is not None:  # busier than a sibling: Triton gives it the next ones
            self._board.wait_turn(lambda: self._work, lambda: self._closing)
        return None

    def _accept(self, request: Any, inputs: dict[str, np.ndarray], t0: float) -> None:
        from dlm_engine import InvalidRequestError, SamplingParams

        sender = request.get_response_sender()
        try:
            if self._closing:
                raise _Refused("overloaded: the server is shutting down")
            if len(self._live) >= self.settings.max_queue:
                raise _Refused(f"overloaded: {len(self._live)} requests in flight, try again later")
            parsed = parse_request(inputs, request.parameters())
            params = self.engine.resolve_params(SamplingParams.from_dict(parsed.sampling))
            prompt_ids = self.engine.encode_prompt(
                **{_ENCODE_KW[parsed.prompt_kind]: parsed.prompt}, tools=params.tools
            )
        except (RequestError, InvalidRequestError) as exc:
            return self._reject(sender, str(exc), "invalid")
        except _Refused as exc:
            return self._reject(sender, str(exc), "overloaded")
        except Exception as exc:  # any failure must still end the request
            return self._reject(sender, f"internal error: {type(exc).__name__}: {exc}", "error")

        rid = f"{request.request_id() or 'req'}#{next(self._ids)}"
        live = _Live(rid, request, sender, parsed.stream, t0)
        # its share of this instance's outstanding work, in token-forwards: a 256-step answer
        # weighs 32x an 8-step one (the load board compares instances by this sum)
        live.work = max(1, params.steps) * (len(prompt_ids) + params.max_tokens)
        with self._live_lock:
            self._live[rid] = live
            self._work += live.work
        self.loop.submit(rid, prompt_ids, params, lambda out, live=live: self._on_output(live, out))

    def _inputs(self, request: Any) -> dict[str, np.ndarray]:
        present = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                present[name] = tensor.as_numpy()
        return present

    def _reject(self, sender: Any, message: str, outcome: str) -> None:
        self.metrics.outcome(outcome)
        error = pb_utils.TritonError(message)
        with contextlib.suppress(Exception):  # a client gone already cannot be told
            sender.send(
                pb_utils.InferenceResponse(output_tensors=[], error=error),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    # ------------------------------------------------------------------ sender thread
    def _send_loop(self) -> None:
        while True:
            wait = CATCH_UP_S if self.step_metrics.catching_up else STEP_METRICS_EVERY_S
            try:
                item = self._outbox.get(timeout=wait)
            except queue.Empty:
                item = ()  # a tick: buffered step figures and gauges
            if item is None:
                return
            if item:
                live, out = item
                try:
                    self._deliver(live, out)
                except Exception as exc:  # never lose the final flag
                    self._fail(live, f"internal error: {type(exc).__name__}: {exc}")
            try:
                self.step_metrics.record(idle=not self._live)
            except Exception as exc:  # a metric must not stop the responses
                pb_utils.Logger.log_warn(f"step metrics: {exc}")

    def _deliver(self, live: _Live, out: RequestOutput) -> None:
        if live.closed:
            return
        if out.error:
            message = str(out.error)
            if not message.startswith(ERROR_PREFIXES):
                message = f"{PREFIX_INTERNAL} {message}"
            self._fail(live, message)
            return
        if out.delta_text and live.first_text_at is None:
            live.first_text_at = time.monotonic()
        if out.logprobs and not live.stream:
            live.logprobs.extend(out.logprobs)
        if not out.finished:
            if live.stream and (out.delta_text or out.canvas is not None or out.logprobs):
                self._send(live, self._response(out.delta_text, "", out), final=False)
            self._record_ttft(live)
            return
        text = out.delta_text if live.stream else out.text
        reason = out.finish_reason or "stop"
        finished_at = time.monotonic()
        if live.cancel_requested:  # the client is gone: end the request without a payload
            self._send(live, None, final=True)
        else:
            logprobs = out.logprobs if live.stream or out.logprobs is None else live.logprobs
            self._send(live, self._response(text or "", reason, out, logprobs), final=True)
        self._record_request(live, out, reason, finished_at)

    def _record_request(
        self, live: _Live, out: RequestOutput, reason: str, finished_at: float
    ) -> None:
        """A finished request's metrics, right after its final response: six round trips to
        tritonserver that would otherwise stand between the last step and the answer (a
        client reading the metrics at once may be a moment early)."""
        m = self.metrics
        self._record_ttft(live)
        m.outcome(reason)
        m.e2e.observe(finished_at - live.t0)
        m.generated_tokens.increment(int(out.completion_tokens or 0))
        if out.steps:
            m.steps_per_request.observe(out.steps)
            m.tokens_per_forward.observe((out.completion_tokens or 0) / out.steps)

    def _record_ttft(self, live: _Live) -> None:
        if live.first_text_at is not None and not live.ttft_recorded:
            live.ttft_recorded = True
            self.metrics.ttft.observe(live.first_text_at - live.t0)

    def _response(
        self, text: str, finish_reason: str, out: RequestOutput, logprobs: list | None = None
    ) -> Any:
        canvas = json.dumps(out.canvas) if out.canvas is not None else ""
        if logprobs is None:
            logprobs = out.logprobs
        values = {
            tensors.TEXT_OUTPUT: text,
            tensors.FINISH_REASON: finish_reason,
            tensors.PROMPT_TOKENS: out.prompt_tokens,
            tensors.COMPLETION_TOKENS: out.completion_tokens,
            tensors.STEPS: out.steps,
            tensors.FORWARDS: out.steps,
            tensors.TOKENS_PER_FORWARD: out.tokens_per_forward,
            tensors.CANVAS: canvas,
            tensors.LOGPROBS: "" if logprobs is None else json.dumps(logprobs, ensure_ascii=False),
            tensors.TOOL_CALLS: json.dumps(out.tool_calls, ensure_ascii=False)
            if out.tool_calls
            else "",
            tensors.SCORE: json.dumps(out.score) if out.score else "",
            tensors.CACHED_TOKENS: out.cached_tokens,
        }
        return pb_utils.InferenceResponse(
            output_tensors=[_output_tensor(spec, values[spec]) for spec in tensors.OUTPUTS]
        )

    def _send(self, live: _Live, response: Any, final: bool) -> None:
        with live.lock:
            if live.closed:
                return
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            if final:
                self._close(live)  # under the lock: nothing polls it once the final is out
            try:
                if response is None:
                    live.sender.send(flags=flags)
                else:
                    live.sender.send(response, flags=flags)
            except Exception:  # e.g. the client went away: still end it
                if not final:
                    return
                with contextlib.suppress(Exception):  # nothing left to tell the client
                    live.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _fail(self, live: _Live, message: str) -> None:
        """Final error response (once), counted by outcome."""
        with live.lock:
            if live.closed:
                return
            self._close(live)
            prefix = message.split(":", 1)[0]
            self.metrics.outcome(
                {"invalid request": "invalid", "overloaded": "overloaded"}.get(prefix, "error")
            )
            try:
                live.sender.send(
                    pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(message)
                    ),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            except Exception:  # cancelled or closed sender
                with contextlib.suppress(Exception):
                    live.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _close(self, live: _Live) -> None:
        live.closed = True
        with self._live_lock:
            if self._live.pop(live.rid, None) is not None:
                self._work -= live.work
        if self._board is not None:
            self._board.publish(self._work)

    # ------------------------------------------------------------------ watcher thread
    def _watch_loop(self) -> None:
        """Client cancel / disconnect -> the row leaves the batch before the next step.
        Also watches the launcher's drain file."""
        drain_deadline: float | None = None
        drained = False
        for tick in itertools.count():
            if self._stop.wait(WATCH_INTERVAL_S):
                return
            if tick % FAULT_POLL_EVERY == 0 and not self._closing:  # (stopping stops ranks)
                fault = self.engine.fault()
                if fault is not None:
                    self._exit_on_fault(fault)
            poll = drain_deadline is None and DRAIN_FILE and tick % DRAIN_POLL_EVERY == 0
            if poll and os.path.exists(DRAIN_FILE):
                self._closing = True
                drain_deadline = time.monotonic() + DRAIN_TIMEOUT_S
                pb_utils.Logger.log_info(
                    f"dlm model {self.model_name}: draining {len(self._live)} requests"
                )
            if drain_deadline is not None and not self._live and not drained:
                drained = True  # tell the launcher this instance is idle: SIGTERM is safe now
                Path(DRAIN_FILE).with_name(f"drained-{self.instance_name}").touch()
            if drain_deadline is not None and time.monotonic() > drain_deadline:
                for live in list(self._live.values()):
                    if not live.abort_sent:
                        live.abort_sent = True
                        self.loop.cancel(live.rid)
            for live in list(self._live.values()):
                # Under the request's lock: once its final response is sent Triton frees the
                # response factory, and is_cancelled() on it then segfaults tritonserver.
                with live.lock:
                    if live.cancel_requested or live.closed:
                        continue
                    try:
                        cancelled = live.request.is_cancelled()
                    except Exception:
                        continue
                if cancelled:
                    live.cancel_requested = True
                    self.loop.cancel(live.rid)

    def _exit_on_fault(self, fault: str) -> None:
        """The engine can serve no more: refuse new requests, let the running ones fail with
        the engine's own error for a moment, end the rest with `fault`, stop the worker ranks
        (by PID, reaped) and exit the stub: the model is then dead to Triton and restarted."""
        self._closing = True
        pb_utils.Logger.log_error(
            f"dlm model {self.model_name}: {fault}; the model process exits so that it is restarted"
        )
        deadline = time.monotonic() + 2.0
        while self._live and time.monotonic() < deadline:
            time.sleep(0.02)
        self._outbox.put(None)  # the sender sends what is queued, then stops
        self._sender.join(timeout=5.0)
        for live in list(self._live.values()):
            self._fail(live, f"internal error: model unavailable: {fault}")
        with contextlib.suppress(Exception):
            self.loop.shutdown(timeout=5.0)  # stops and reaps the worker ranks
        if self._board is not None:
            self._board.close()
        os._exit(FAULT_EXIT_STATUS)


class _Refused(Exception):
    """Not accepted now (queue full, shutting down); the message carries its prefix."""


_ENCODE_KW = {"text_input": "text", "messages": "messages", "input_ids": "input_ids"}
