"""A small typed client for the dlm Triton models (gRPC streaming and HTTP).

It speaks the tensor contract of docs/architecture.md and nothing more: the OpenAI surface is
the proxy's job. A client keeps one gRPC channel and makes one stream call per request
(``grpc_stream``), so calls from many threads never share callbacks; closing a stream iterator
early cancels the request on the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlm_protocol import tensors
from dlm_protocol.errors import PREFIX_INVALID
from dlm_protocol.response import tokens_per_forward

from .grpc_stream import GrpcChannel, StreamError, infer_request

OUTPUTS = tensors.OUTPUT_NAMES


class DLMError(RuntimeError):
    """A request failed; ``message`` starts with ``invalid request:``, ``overloaded:`` or
    ``internal error:`` when the model produced it."""

    @property
    def invalid(self) -> bool:
        return PREFIX_INVALID in str(self)


@dataclass
class Chunk:
    """One response: the delta text when streaming, the whole completion otherwise."""

    text: str
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    canvas: list[str | None] | None = None
    forwards: int = 0  # forwards (NFE) used so far
    tokens_per_forward: float = 0.0
    # with the `logprobs` key: one entry per token of `text` (dlm_protocol.response.LOGPROB_FIELDS)
    logprobs: list[dict[str, Any]] | None = None
    # with `tools`, on the last chunk: the calls in OpenAI's shape (finish_reason `tool_calls`)
    tool_calls: list[dict[str, Any]] | None = None
    # with `score`, on the last chunk: {log_likelihood, variance, mc_samples, tokens}
    score: dict[str, Any] | None = None

    @property
    def final(self) -> bool:
        return bool(self.finish_reason)

    @classmethod
    def from_fields(cls, get: Any) -> Chunk:
        """Build from a getter ``name -> scalar`` (gRPC numpy or HTTP JSON)."""

        def text(name: str) -> str:
            value = get(name)
            return value.decode("utf-8") if isinstance(value, bytes) else str(value or "")

        canvas = text(tensors.CANVAS.name)
        logprobs = text(tensors.LOGPROBS.name)
        tool_calls = text(tensors.TOOL_CALLS.name)
        score = text(tensors.SCORE.name)
        steps = int(get(tensors.STEPS.name) or 0)
        forwards = int(get(tensors.FORWARDS.name) or steps)
        completion = int(get(tensors.COMPLETION_TOKENS.name) or 0)
        return cls(
            text=text(tensors.TEXT_OUTPUT.name),
            finish_reason=text(tensors.FINISH_REASON.name),
            prompt_tokens=int(get(tensors.PROMPT_TOKENS.name) or 0),
            completion_tokens=completion,
            steps=steps,
            canvas=json.loads(canvas) if canvas else None,
            forwards=forwards,
            tokens_per_forward=tokens_per_forward(completion, forwards),
            logprobs=json.loads(logprobs) if logprobs else None,
            tool_calls=json.loads(tool_calls) if tool_calls else None,
            score=json.loads(score) if score else None,
        )


@dataclass
class Completion:
    """A finished request (streamed deltas joined)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    steps: int
    chunks: int = 1
    logprobs: list[dict[str, Any]] | None = None  # the chunks' entries joined
    tool_calls: list[dict[str, Any]] | None = None  # the last chunk's
    score: dict[str, Any] | None = None  # the last chunk's (scoring requests)

    @property
    def forwards(self) -> int:
        """Forwards (NFE) the request used (`steps` is the older name)."""
        return self.steps

    @property
    def tokens_per_forward(self) -> float:
        return tokens_per_forward(self.completion_tokens, self.steps)


def build_inputs(
    prompt: str | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    input_ids: list[int] | None = None,
    stream: bool | None = None,
    sampling: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Contract tensors (with the batch dimension of 1) for one request."""
    t = tensors
    arrays: dict[str, np.ndarray] = {}
    if prompt is not None:
        arrays[t.TEXT_INPUT.name] = _bytes(prompt)
    if messages is not None:
        arrays[t.MESSAGES.name] = _bytes(json.dumps(messages))
    if input_ids is not None:
        arrays[t.INPUT_IDS.name] = np.array([list(input_ids)], dtype=t.INPUT_IDS.numpy_dtype)
    if stream is not None:
        arrays[t.STREAM.name] = np.array([[bool(stream)]], dtype=t.STREAM.numpy_dtype)
    if sampling:
        arrays[t.SAMPLING_PARAMETERS.name] = _bytes(json.dumps(sampling))
    return arrays


def _bytes(text: str) -> np.ndarray:
    return np.array([[text.encode("utf-8")]], dtype=np.object_)


class DLMClient:
    """Client for one model. ``url`` is the gRPC address (``host:8001``); ``http_url`` the
    HTTP base (``http://host:8000``) used by :meth:`generate_http` / :meth:`stream_http`."""

    def __init__(
        self,
        url: str = "127.0.0.1:8001",
        model: str = "tiny-dlm",
        *,
        http_url: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.url = url
        self.model = model
        self.http_url = http_url or f"http://{url.rsplit(':', 1)[0]}:8000"
        self.timeout_s = timeout_s  # a gRPC request's deadline; an HTTP read's timeout
        self._grpc = GrpcChannel(url)  # one channel, one stream call per request

    # ------------------------------------------------------------------ gRPC
    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        input_ids: list[int] | None = None,
        stream: bool = True,
        parameters: dict[str, Any] | None = None,
        request_id: str = "",
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """Yield responses over one gRPC stream call until the final one. ``sampling`` keys go
        in the ``sampling_parameters`` tensor, ``parameters`` as Triton request parameters.
        Stopping the iteration early cancels the request on the server."""
        arrays = build_inputs(
            prompt, messages=messages, input_ids=input_ids, stream=stream, sampling=sampling
        )
        request = infer_request(self.model, arrays, OUTPUTS, request_id, parameters)
        try:
            for result in self._grpc.stream(request, self.timeout_s, _is_final):
                yield _chunk(result)
        except StreamError as exc:
            raise DLMError(str(exc)) from exc

    def close(self) -> None:
        """Close the gRPC channel (the next call opens another)."""
        self._grpc.close()

    def __enter__(self) -> DLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, prompt: str | None = None, *, stream: bool = False, **kwargs: Any
    ) -> Completion:
        """Run one request to completion over gRPC (streamed deltas joined if ``stream``)."""
        return _join(self.stream(prompt, stream=stream, **kwargs))

    # ------------------------------------------------------------------ HTTP
    def _http_body(
        self, prompt: str | None, messages: Any, input_ids: Any, stream: bool, sampling: dict
    ) -> dict:
        t = tensors
        body: dict[str, Any] = {t.STREAM.name: stream}
        if prompt is not None:
            body[t.TEXT_INPUT.name] = prompt
        if messages is not None:
            body[t.MESSAGES.name] = json.dumps(messages)
        if input_ids is not None:
            body[t.INPUT_IDS.name] = list(input_ids)
        if sampling:
            body[t.SAMPLING_PARAMETERS.name] = json.dumps(sampling)
        return body

    def stream_http(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        input_ids: list[int] | None = None,
        stream: bool = True,
        **sampling: Any,
    ) -> Iterator[Chunk]:
        """``POST /v2/models/<m>/generate_stream`` and parse its server-sent events."""
        import httpx

        url = f"{self.http_url}/v2/models/{self.model}/generate_stream"
        body = self._http_body(prompt, messages, input_ids, stream, sampling)
        with (
            httpx.Client(timeout=self.timeout_s) as http,
            http.stream("POST", url, json=body) as resp,
        ):
            if resp.status_code != 200:
                raise DLMError(_http_error(resp.read()))
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:].strip())
                if "error" in event:
                    raise DLMError(str(event["error"]))
                chunk = Chunk.from_fields(event.get)
                yield chunk
                if chunk.final:
                    return

    def generate_http(
        self, prompt: str | None = None, *, stream: bool = False, **kwargs: Any
    ) -> Completion:
        return _join(self.stream_http(prompt, stream=stream, **kwargs))

    # ------------------------------------------------------------------ server
    def ready(self) -> bool:
        """Is the model ready (HTTP)?"""
        import httpx

        try:
            r = httpx.get(f"{self.http_url}/v2/models/{self.model}/ready", timeout=5)
        except httpx.HTTPError:
            return False
        return r.status_code == 200


def _chunk(result: Any) -> Chunk:
    return Chunk.from_fields(lambda name: _first(result.as_numpy(name)))


def _is_final(result: Any) -> bool:
    return bool(_first(result.as_numpy(tensors.FINISH_REASON.name)))


def _first(array: np.ndarray | None) -> Any:
    if array is None:
        return None
    flat = array.reshape(-1)
    return (
        flat[0].item() if hasattr(flat[0], "item") and not isinstance(flat[0], bytes) else flat[0]
    )


def _join(chunks: Iterator[Chunk]) -> Completion:
    parts, last, count = [], None, 0
    logprobs: list[dict[str, Any]] | None = None
    for chunk in chunks:
        parts.append(chunk.text)
        last, count = chunk, count + 1
        if chunk.logprobs is not None:
            logprobs = (logprobs or []) + chunk.logprobs
    if last is None:
        raise DLMError("the stream ended without a response")
    return Completion("".join(parts), last.finish_reason, last.prompt_tokens,
                      last.completion_tokens, last.steps, count, logprobs,
                      last.tool_calls, last.score)  # fmt: skip


def _http_error(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body.decode(errors="replace")))
    except (json.JSONDecodeError, AttributeError):
        return body.decode(errors="replace")
