"""SSE framing from merged (job, event) pairs: chunk shapes, usage, denoise fields, errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from openai_proxy.converters import TritonEvent, TritonJob
from openai_proxy.sse import ChunkBuilder, stream_events


def job(i: int, prompt_index: int = 0) -> TritonJob:
    return TritonJob(f"r-{i}", i, prompt_index, "messages", "[]", {}, True)


async def feed(pairs: list[tuple[TritonJob, TritonEvent]]) -> AsyncIterator[Any]:
    for pair in pairs:
        yield pair


def run(builder: ChunkBuilder, jobs: list[TritonJob], pairs: list) -> list[Any]:
    async def collect() -> list[bytes]:
        return [b async for b in stream_events(builder, jobs, feed(pairs))]

    out = []
    for raw in asyncio.run(collect()):
        text = raw.decode()
        assert text.startswith("data: ") and text.endswith("\n\n")
        body = text[6:-2]
        out.append(body if body == "[DONE]" else json.loads(body))
    return out


def ev(text: str = "", reason: str | None = None, **kw: Any) -> TritonEvent:
    return TritonEvent(text=text, finish_reason=reason, final=reason is not None, **kw)


def test_chat_stream_shape_and_usage() -> None:
    jobs = [job(0), job(1)]
    pairs = [
        (jobs[0], ev("Hel", prompt_tokens=5, completion_tokens=1)),
        (jobs[1], ev("Yo", prompt_tokens=5, completion_tokens=1)),
        (jobs[0], ev("lo", "stop", prompt_tokens=5, completion_tokens=3)),
        (jobs[1], ev("", "length", prompt_tokens=5, completion_tokens=4)),
    ]
    out = run(ChunkBuilder("chat", "chatcmpl-1", 7, "m", usage=True), jobs, pairs)
    assert out[-1] == "[DONE]"
    chunks = out[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)
    first = chunks[0]["choices"]
    assert [c["delta"] for c in first] == [{"role": "assistant", "content": ""}] * 2
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[1:-1]:
        assert c["usage"] is None
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
            assert choice["delta"] == {}
    assert text == {0: "Hello", 1: "Yo"} and finish == {0: "stop", 1: "length"}
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def test_completion_stream_without_usage_and_with_canvas() -> None:
    j = job(0)
    pairs = [
        (j, ev("", canvas=["a", None], steps=1)),
        (j, ev("ab", canvas=["a", "b"], steps=2)),
        (j, ev("", "stop")),
    ]
    out = run(ChunkBuilder("completion", "cmpl-1", 7, "m", usage=False), [j], pairs)
    chunks = out[:-1]
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["canvas"] == ["a", None]
    assert chunks[1]["choices"][0] == {
        "index": 0, "text": "ab", "logprobs": None, "finish_reason": None,
        "canvas": ["a", "b"], "steps": 2,
    }  # fmt: skip
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "canvas" not in chunks[-1]["choices"][0]


def test_server_abort_becomes_an_error_event() -> None:
    j = job(0)
    out = run(
        ChunkBuilder("chat", "c", 1, "m", usage=True), [j], [(j, ev("x")), (j, ev("", "abort"))]
    )
    assert out[-1] == "[DONE]"
    err = out[-2]["error"]
    assert err["type"] == "service_unavailable" and "abort" in err["message"]
