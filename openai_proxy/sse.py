"""Server-sent events in OpenAI's chunk format, built from merged Triton events.

Chunks are plain dicts serialised with json.dumps (denoise mode sends one per step, so this path
avoids pydantic); their shapes are documented by ChatCompletionChunk in schemas.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from .converters import (
    ChoiceResult,
    TritonEvent,
    TritonJob,
    chat_logprobs,
    completion_logprobs,
    openai_finish_reason,
    score_fields,
    usage_of,
)
from .errors import ProxyError, ServiceUnavailable

DONE = b"data: [DONE]\n\n"


def encode(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


class ChunkBuilder:
    """Makes chat or completion chunks for one response id."""

    def __init__(self, kind: str, response_id: str, created: int, model: str, usage: bool):
        self.kind = kind  # "chat" | "completion"
        self.response_id = response_id
        self.created = created
        self.model = model
        self.usage = usage

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.kind == "chat":
            chunk["system_fingerprint"] = None
        if self.usage:
            chunk["usage"] = None
        return chunk

    def choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        event: TritonEvent | None = None,
        offset: int = 0,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            c: dict[str, Any] = {"index": index, "delta": delta}
        else:
            c = {"index": index, "text": text or ""}
        c["logprobs"] = None
        if event is not None and event.logprobs is not None:  # the tokens of this piece
            c["logprobs"] = (
                chat_logprobs(event.logprobs)
                if self.kind == "chat"
                else completion_logprobs(event.logprobs, offset)
            )
        c["finish_reason"] = finish_reason
        if event is not None and event.score:  # a scored prompt's totals
            c.update(score_fields(event.score))
        if event is not None and event.canvas is not None:
            c["canvas"] = event.canvas
            c["steps"] = event.steps
        return c

    def tool_calls(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """A chat choice whose delta carries the answer's tool calls, each with its index."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        return encode(self._chunk(choices))

    def usage_chunk(self, results: list[ChoiceResult]) -> bytes:
        chunk = self._chunk([])
        chunk["usage"] = usage_of(results)
        return encode(chunk)


async def stream_events(
    builder: ChunkBuilder,
    jobs: list[TritonJob],
    events: AsyncIterator[tuple[TritonJob, TritonEvent]],
    on_finish: Callable[[list[ChoiceResult]], None] | None = None,
) -> AsyncIterator[bytes]:
    """Turn merged (job, event) pairs into SSE bytes, ending with usage (opt-in) and [DONE].

    Errors after the headers went out cannot change the status any more: they are sent as an
    OpenAI error object in a data line (the openai client raises it as APIError).
    """
    results = {j.choice_index: ChoiceResult(j.choice_index, j.prompt_index) for j in jobs}
    if builder.kind == "chat":
        yield builder.chunk([builder.choice(j.choice_index, "", role=True) for j in jobs])
    try:
        async for job, ev in events:
            r = results[job.choice_index]
            r.absorb(ev)
            if ev.text or ev.canvas is not None or ev.logprobs:
                offset = len(r.text) - len(ev.text)
                choice = builder.choice(job.choice_index, ev.text, event=ev, offset=offset)
                yield builder.chunk([choice])
            if ev.final:
                reason = openai_finish_reason(ev.finish_reason)
                if reason is None:
                    raise ServiceUnavailable(
                        f"generation ended by the server ({ev.finish_reason or 'no reason'})"
                    )
                r.finish_reason = reason
                if ev.tool_calls and builder.kind == "chat":  # every call whole
                    yield builder.chunk([builder.tool_calls(job.choice_index, ev.tool_calls)])
                text = None if builder.kind == "chat" else ""
                yield builder.chunk([builder.choice(job.choice_index, text, reason)])
    except ProxyError as err:
        yield encode(err.to_dict())
        yield DONE
        return
    done = list(results.values())
    if on_finish is not None:
        on_finish(done)
    if builder.usage:
        yield builder.usage_chunk(done)
    yield DONE
