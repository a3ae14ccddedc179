"""One Triton stream per job: the job as the contract's input tensors, each response decoded
to a `TritonEvent`, and gRPC / Triton failures mapped to the proxy's errors.

Why a stream even for non-streaming calls: the served models are decoupled, and a gRPC stream
is the one Triton path where a client cancel reaches the model (the row leaves the batch), and
where TRITON_NOTES found cancellations clean at shutdown. Tensor names and datatypes come from
the request contract (`dlm_protocol.tensors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferResult
from tritonclient.utils import InferenceServerException

from dlm_protocol import tensors

from .config import ProxyConfig
from .converters import TritonEvent, TritonJob
from .errors import ProxyError, ServiceUnavailable, UpstreamTimeout, from_triton_message
from .idle import idle_timeout
from .triton_pool import BackendState, TritonPool


class TritonStreams:
    """Opens streams on the pool's servers and counts them (for /metrics)."""

    def __init__(self, config: ProxyConfig, pool: TritonPool) -> None:
        self.config = config
        self.pool = pool
        self.opened = 0
        self.cancelled = 0
        self.errors = 0

    async def open(
        self, st: BackendState, model: str, job: TritonJob
    ) -> AsyncIterator[TritonEvent]:
        """Events of one job on server `st` until its final one; closing the generator early
        cancels the Triton request (the row leaves the batch)."""
        try:
            batched = await self.pool.batch_dim(st, model) > 0
        except Exception as exc:
            raise map_exception(exc, self.config.retry_after_s) from None
        finished = asyncio.Event()
        request = {
            "model_name": model,
            "inputs": request_inputs(job, batched),
            "request_id": job.request_id,
        }

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield request
            # Keep our half of the stream open until the final response: some servers end a
            # stream as soon as the client half-closes.
            await finished.wait()

        call = st.client.stream_infer(requests(), stream_timeout=self.config.request_timeout_s)
        st.in_flight += 1
        st.attempts += 1
        self.opened += 1
        complete = False
        try:
            idle_s = self.config.stream_idle_timeout_s
            async for result, error in idle_timeout(call, idle_s, lambda: _idle_error(idle_s)):
                if error is not None:
                    self.errors += 1
                    raise from_triton_message(error.message(), self.config.retry_after_s)
                event = decode_result(result)
                if event.finish_reason:
                    event.final = True
                yield event
                if event.final:
                    complete = True
                    return
            raise ServiceUnavailable(
                "Triton closed the stream before the final response", self.config.retry_after_s
            )
        except ProxyError:
            raise
        except Exception as exc:
            self.errors += 1
            raise map_exception(exc, self.config.retry_after_s) from None
        finally:
            st.in_flight -= 1
            finished.set()
            if not complete:
                # Client gone, error or shutdown: tell Triton now so the row leaves the batch.
                self.cancelled += 1
                call.cancel()


def request_inputs(job: TritonJob, batched: bool) -> list[InferInput]:
    """The contract's input tensors for one job (a leading batch dim of 1 when `batched`)."""
    lead = [1] if batched else []

    def tensor(spec: tensors.TensorSpec, value: Any) -> InferInput:
        array = np.asarray(value, dtype=spec.numpy_dtype).reshape([*lead, -1])
        inp = InferInput(spec.name, list(array.shape), spec.datatype)
        inp.set_data_from_numpy(array)
        return inp

    prompt = tensors.BY_NAME[job.prompt_input]
    value = job.prompt_value
    if prompt.datatype == "BYTES":
        value = [str(value).encode("utf-8")]
    params = json.dumps(job.sampling_parameters).encode("utf-8")
    return [
        tensor(prompt, value),
        tensor(tensors.STREAM, [job.stream]),
        tensor(tensors.SAMPLING_PARAMETERS, [params]),
    ]


def _as_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return "" if value is None else str(value)


def _first(result: InferResult, name: str) -> Any:
    arr = result.as_numpy(name)
    if arr is None or arr.size == 0:
        return None
    return arr.reshape(-1)[0]


def decode_result(result: InferResult) -> TritonEvent:
    """Decode the outputs of one Triton response (missing outputs read as empty)."""
    canvas_raw = _as_str(_first(result, tensors.CANVAS.name))
    canvas = json.loads(canvas_raw) if canvas_raw else None
    logprobs_raw = _as_str(_first(result, tensors.LOGPROBS.name))
    tool_calls_raw = _as_str(_first(result, tensors.TOOL_CALLS.name))
    score_raw = _as_str(_first(result, tensors.SCORE.name))
    reason = _as_str(_first(result, tensors.FINISH_REASON.name)) or None

    def num(name: str) -> int:
        v = _first(result, name)
        return int(v) if v is not None else 0

    final = False
    with contextlib.suppress(Exception):
        params = result.get_response().parameters
        if "triton_final_response" in params:
            final = bool(params["triton_final_response"].bool_param)
    steps = num(tensors.STEPS.name)
    return TritonEvent(
        text=_as_str(_first(result, tensors.TEXT_OUTPUT.name)),
        finish_reason=reason,
        prompt_tokens=num(tensors.PROMPT_TOKENS.name),
        completion_tokens=num(tensors.COMPLETION_TOKENS.name),
        steps=steps,
        canvas=canvas,
        final=final,
        forwards=num(tensors.FORWARDS.name) or steps,
        logprobs=json.loads(logprobs_raw) if logprobs_raw else None,
        tool_calls=json.loads(tool_calls_raw) if tool_calls_raw else None,
        score=json.loads(score_raw) if score_raw else None,
        cached_tokens=_cached_tokens(result),
    )


def _cached_tokens(result: InferResult) -> int | None:
    """Prompt tokens served from the prefix cache; None from a model that does not say."""
    value = _first(result, tensors.CACHED_TOKENS.name)
    return None if value is None else int(value)


def map_exception(exc: BaseException, retry_after_s: int) -> ProxyError:
    """gRPC status codes we can trust (connection level) first, then Triton's message."""
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return ServiceUnavailable(
                f"Triton is unavailable: {exc.details()}", retry_after_s, code="triton_unavailable"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return UpstreamTimeout("Triton did not finish in time", code="timeout")
        if code == grpc.StatusCode.NOT_FOUND:
            return from_triton_message(exc.details() or "unknown model", retry_after_s)
        return from_triton_message(exc.details() or code.name, retry_after_s)
    if isinstance(exc, InferenceServerException):
        status = (exc.status() or "").upper()
        if "UNAVAILABLE" in status:
            return ServiceUnavailable(
                f"Triton is unavailable: {exc.message()}", retry_after_s, code="triton_unavailable"
            )
        return from_triton_message(exc.message() or str(exc), retry_after_s)
    return from_triton_message(str(exc), retry_after_s)


def _idle_error(idle_s: float) -> UpstreamTimeout:
    return UpstreamTimeout(f"Triton sent nothing for {idle_s:g} s", code="upstream_idle")
