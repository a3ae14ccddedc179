"""One gRPC stream call per request over a channel the client keeps.

tritonclient's synchronous ``start_stream`` opens a channel, starts a response thread and joins
it again for every call, which costs a request more than the rest of the client does.
Here the channel lives as long as the ``DLMClient`` and each request is one
``ModelStreamInfer`` call read in the caller's thread: the client half-closes after its one
request and Triton ends the call once the final response is out, so nothing waits or leaks,
and cancelling the call cancels that request only (calls from many threads never share
callbacks).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from dlm_protocol import tensors

# as tritonclient's own channels: responses carry whole canvases and logprob lists
_MAX_MESSAGE = 2**31 - 1
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
]


class StreamError(RuntimeError):
    """The call failed (the server's error message, or the transport's)."""


def infer_request(
    model: str,
    arrays: dict[str, np.ndarray],
    outputs: tuple[str, ...],
    request_id: str = "",
    parameters: dict[str, Any] | None = None,
) -> service_pb2.ModelInferRequest:
    """The contract tensors as one ``ModelInferRequest`` (raw contents, as tritonclient sends)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, array in arrays.items():
        spec = tensors.BY_NAME[name]
        request.inputs.add(name=name, datatype=spec.datatype, shape=list(array.shape))
        if spec.datatype == "BYTES":
            request.raw_input_contents.append(serialize_byte_tensor(array).item())
        else:
            request.raw_input_contents.append(array.astype(spec.numpy_dtype).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        _set_parameter(request.parameters[key], key, value)
    return request


def _set_parameter(param: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    elif isinstance(value, str):
        param.string_param = value
    else:
        raise TypeError(f"parameters: {key}: expected bool, int, float or str")


class GrpcChannel:
    """A lazily opened channel to one server, shared by every thread of a client."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None

    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        with self._lock:
            if self._stub is None:
                self._channel = grpc.insecure_channel(self.url, options=_CHANNEL_OPTIONS)
                self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
            return self._stub

    def close(self) -> None:
        """Close the channel (a later call opens a new one)."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None

    def stream(
        self,
        request: service_pb2.ModelInferRequest,
        timeout_s: float,
        is_final: Callable[[InferResult], bool],
    ) -> Iterator[InferResult]:
        """Yield the request's responses up to the final one. Stopping before it (``close()``
        on the generator) cancels the call, which Triton reports to the model as a cancelled
        request; after it, the call's closing status is read (Triton sends it right after)."""
        call = self.stub().ModelStreamInfer(iter((request,)), timeout=timeout_s)
        final = ended = False
        try:
            for response in call:
                if response.error_message:  # an error response is the request's last
                    ended = True
                    raise StreamError(response.error_message)
                result = InferResult(response.infer_response)
                final = is_final(result)
                yield result
                if final:
                    break
            else:
                ended = True
        except grpc.RpcError as exc:
            ended = True
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StreamError(f"no final response within {timeout_s}s") from exc
            raise StreamError(exc.details() or str(exc.code())) from exc
        finally:
            if final:
                with contextlib.suppress(grpc.RpcError):
                    for _ in call:  # nothing follows the final response but the status
                        pass
            elif not ended:
                call.cancel()
