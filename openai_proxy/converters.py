"""OpenAI request → Triton jobs, and Triton results → OpenAI response bodies.

Kept free of tritonclient and numpy so it is unit-tested without a server: a `TritonJob` holds
plain Python values; `triton_backend` turns them into tensors.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dlm_protocol.response import OPENAI_FINISH_REASONS, ROLE_ALIASES, tokens_per_forward
from dlm_protocol.tensors import INPUT_IDS, MESSAGES, TEXT_INPUT

from .config import ProxyConfig
from .errors import InvalidRequest
from .schemas import (
    DIFFUSION_KEYS,
    ChatCompletionRequest,
    CompletionRequest,
    _RequestBase,
)

FINISH_REASONS = OPENAI_FINISH_REASONS


@dataclass
class TritonJob:
    """One Triton request: one prompt, one choice."""

    request_id: str
    choice_index: int
    prompt_index: int
    # Exactly one of the three prompt inputs of the Triton contract.
    prompt_input: str  # "messages" | "text_input" | "input_ids"
    prompt_value: str | list[int]
    sampling_parameters: dict[str, Any]
    stream: bool


@dataclass
class TritonEvent:
    """One Triton response, decoded (see the output table in docs/architecture.md)."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    canvas: list[str | None] | None = None
    final: bool = False
    forwards: int = 0  # forwards (NFE) used so far; 0 = not reported
    logprobs: list[dict[str, Any]] | None = None  # entries for the tokens of `text`
    tool_calls: list[dict[str, Any]] | None = None  # on the final event, with tools
    score: dict[str, Any] | None = None  # on the final event of a scoring request
    cached_tokens: int | None = None  # prompt tokens from the prefix cache; None = not reported


@dataclass
class ChoiceResult:
    """What a finished choice accumulated."""

    index: int
    prompt_index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    forwards: int = 0
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    score: dict[str, Any] | None = None
    cached_tokens: int | None = None

    def absorb(self, ev: TritonEvent) -> None:
        """Take one Triton response of this choice into the running totals."""
        self.text += ev.text
        if ev.logprobs is not None:
            self.logprobs = (self.logprobs or []) + ev.logprobs
        if ev.tool_calls:
            self.tool_calls = ev.tool_calls
        if ev.score:
            self.score = ev.score
        self.prompt_tokens = ev.prompt_tokens or self.prompt_tokens
        self.completion_tokens = ev.completion_tokens or self.completion_tokens
        self.forwards = ev.forwards or self.forwards
        if ev.cached_tokens is not None:
            self.cached_tokens = ev.cached_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sampling_parameters(req: _RequestBase, choice: int, limits: ProxyConfig) -> dict[str, Any]:
    """The `sampling_parameters` JSON for choice `choice` (seed + choice when seeded)."""
    max_tokens = req.effective_max_tokens()
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens {max_tokens} exceeds this server's limit of {limits.max_tokens_limit}",
            param="max_tokens",
            code="invalid_value",
        )
    params: dict[str, Any] = {}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if req.seed is not None:
        params["seed"] = req.seed + choice
    stops = req.stop_list()
    if stops:
        params["stop"] = stops
    logprobs = req.logprobs_key()
    if logprobs is not None:
        params["logprobs"] = logprobs
    if req.is_scoring():  # echo + max_tokens 0 = the contract's `score`
        params.pop("max_tokens", None)
        params["score"] = True
    for key in DIFFUSION_KEYS:
        value = getattr(req, key)
        if value is not None:
            params[key] = value
    return params


def _check_fanout(prompts: int, n: int, limits: ProxyConfig) -> None:
    if n > limits.max_n:
        raise InvalidRequest(
            f"n={n} exceeds this server's limit of {limits.max_n}", param="n", code="invalid_value"
        )
    if prompts * n > limits.max_fanout:
        raise InvalidRequest(
            f"{prompts} prompts x n={n} = {prompts * n} generations exceed this server's "
            f"limit of {limits.max_fanout}",
            param="n",
            code="invalid_value",
        )


def check_admissible(jobs: list[TritonJob], n: int, capacity: int | None, model: str) -> None:
    """A call whose generations can never all be admitted at once is a 400 naming `n`, not the
    503 "try again later" that every retry would get again. `capacity`: the requests the
    servers of `model` admit at once (`TritonPool.queue_capacity`; None = unknown, no check)."""
    if capacity is None or len(jobs) <= capacity:
        return
    prompts = len({j.prompt_index for j in jobs})
    asked = f"n={n}" if prompts == 1 else f"{prompts} prompts x n={n} = {len(jobs)} generations"
    raise InvalidRequest(
        f"{asked} exceed{'s' if prompts == 1 else ''} the {capacity} requests this server "
        f"admits at once for model '{model}' (its max_queue): ask for at most {capacity} "
        "generations per call",
        param="n",
        code="invalid_value",
    )


def messages_json(req: ChatCompletionRequest) -> str:
    """The `messages` input: OpenAI messages flattened to {role, content} strings.

    `developer` is OpenAI's newer name for `system`; chat templates of the served checkpoints
    only know `system`.
    """
    out = []
    for m in req.messages:
        role = ROLE_ALIASES.get(m.role, m.role)
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:  # an assistant's calls and the tool results go back
            msg["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return json.dumps(out, ensure_ascii=False)


def chat_jobs(req: ChatCompletionRequest, base_id: str, limits: ProxyConfig) -> list[TritonJob]:
    """n jobs for one chat request."""
    _check_fanout(1, req.n, limits)
    msgs = messages_json(req)
    return [
        TritonJob(
            request_id=f"{base_id}-{i}",
            choice_index=i,
            prompt_index=0,
            prompt_input=MESSAGES.name,
            prompt_value=msgs,
            sampling_parameters=sampling_parameters(req, i, limits),
            stream=req.stream,
        )
        for i in range(req.n)
    ]


def completion_jobs(req: CompletionRequest, base_id: str, limits: ProxyConfig) -> list[TritonJob]:
    """len(prompts) * n jobs; choice index = prompt_index * n + i as in OpenAI."""
    prompts = req.prompts()
    _check_fanout(len(prompts), req.n, limits)
    jobs = []
    for p_idx, prompt in enumerate(prompts):
        for i in range(req.n):
            index = p_idx * req.n + i
            jobs.append(
                TritonJob(
                    request_id=f"{base_id}-{index}",
                    choice_index=index,
                    prompt_index=p_idx,
                    prompt_input=TEXT_INPUT.name if isinstance(prompt, str) else INPUT_IDS.name,
                    prompt_value=prompt,
                    sampling_parameters=sampling_parameters(req, i, limits),
                    stream=req.stream,
                )
            )
    return jobs


def openai_finish_reason(reason: str | None) -> str | None:
    """Triton's `stop` / `length` pass through; anything else is not an OpenAI reason."""
    if reason in FINISH_REASONS:
        return reason
    return None


def usage_of(results: list[ChoiceResult]) -> dict[str, Any]:
    """Prompt tokens counted once per prompt (as OpenAI does for n > 1), completions summed.

    The diffusion extras (`forwards`, `tokens_per_forward`; see dlm_protocol.response) are
    added when Triton reported forwards: summed over choices, like completion tokens.
    """
    prompt_tokens: dict[int, int] = {}
    for r in results:
        prompt_tokens[r.prompt_index] = max(prompt_tokens.get(r.prompt_index, 0), r.prompt_tokens)
    p = sum(prompt_tokens.values())
    c = sum(r.completion_tokens for r in results)
    usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    forwards = sum(r.forwards for r in results)
    if forwards:
        usage["forwards"] = forwards
        usage["tokens_per_forward"] = tokens_per_forward(c, forwards)
    cached = cached_tokens_of(results)
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def cached_tokens_of(results: list[ChoiceResult]) -> int | None:
    """OpenAI's `prompt_tokens_details.cached_tokens`: per prompt, the tokens every choice of
    it reused from the prefix cache (prompts count once, as `prompt_tokens`); None when Triton
    did not report them."""
    if all(r.cached_tokens is None for r in results):
        return None
    per_prompt: dict[int, int] = {}
    for r in results:
        own = r.cached_tokens or 0
        per_prompt[r.prompt_index] = min(per_prompt.get(r.prompt_index, own), own)
    return sum(per_prompt.values())


def chat_response(
    response_id: str, created: int, model: str, results: list[ChoiceResult]
) -> dict[str, Any]:
    results = sorted(results, key=lambda r: r.index)
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": r.index,
                "message": assistant_message(r),
                "finish_reason": openai_finish_reason(r.finish_reason),
                "logprobs": chat_logprobs(r.logprobs),
            }
            for r in results
        ],
        "usage": usage_of(results),
        "system_fingerprint": None,
    }


def completion_response(
    response_id: str, created: int, model: str, results: list[ChoiceResult]
) -> dict[str, Any]:
    results = sorted(results, key=lambda r: r.index)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": r.index,
                "text": r.text,
                "finish_reason": openai_finish_reason(r.finish_reason),
                "logprobs": completion_logprobs(r.logprobs),
                **score_fields(r.score),
            }
            for r in results
        ],
        "usage": usage_of(results),
    }


# ---- logprobs in OpenAI's shapes (entries: dlm_protocol.response.LOGPROB_FIELDS) ----


def _top(entry: dict[str, Any]) -> dict[str, Any]:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": entry["bytes"]}


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """Chat's `logprobs`: `content` holds OpenAI's per-token objects plus the `step` that
    committed each token."""
    if entries is None:
        return None
    content = [
        {**_top(e), "top_logprobs": [_top(t) for t in e["top_logprobs"]], "step": e["step"]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: list[dict[str, Any]] | None, offset: int = 0
) -> dict[str, Any] | None:
    """Completions' legacy `logprobs` (parallel lists) plus `steps`; `offset` is where this
    piece's text starts in the choice's text (for streamed pieces)."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    if entries and "variance" in entries[0]:  # a scoring request's per-token estimates
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": None,
            "text_offset": offsets,
            "variances": [e["variance"] for e in entries],
        }
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
        "steps": [e["step"] for e in entries],
    }


def assistant_message(r: ChoiceResult) -> dict[str, Any]:
    """The answer's message; with tool calls, `tool_calls` and the text before them (null when
    there is none), as OpenAI answers."""
    if not r.tool_calls:
        return {"role": "assistant", "content": r.text}
    return {"role": "assistant", "content": r.text or None, "tool_calls": r.tool_calls}


def score_fields(score: dict[str, Any] | None) -> dict[str, Any]:
    """A scored prompt's totals as extra fields of its completion choice."""
    if not score:
        return {}
    return {
        "log_likelihood": score["log_likelihood"],
        "log_likelihood_variance": score["variance"],
        "mc_samples": score["mc_samples"],
    }
