"""What the engine hands back after a step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dlm_protocol.response import tokens_per_forward


@dataclass
class RequestOutput:
    """A request's progress. `delta_text` only ever appends to what was sent before."""

    request_id: str
    text: str
    delta_text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    steps: int
    canvas: list[str | None] | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # requests with `logprobs`: one entry per completion token newly covered by this
    # output's text (as `delta_text`; all remaining ones on the final output), each
    # {token_id, token, bytes, logprob, step, top_logprobs} (dlm_protocol.response.LOGPROB_FIELDS)
    logprobs: list[dict[str, Any]] | None = None
    # requests with tools: on the final output, the calls in OpenAI's shape
    # ({id, type: function, function: {name, arguments}}); `finish_reason` is then `tool_calls`
    tool_calls: list[dict[str, Any]] | None = None
    # scoring requests (`score`): {log_likelihood, variance, mc_samples, tokens}
    score: dict[str, Any] | None = None
    # prompt tokens reused from the prefix cache (block-diffusion models; OpenAI's
    # `usage.prompt_tokens_details.cached_tokens`)
    cached_tokens: int = 0

    @property
    def forwards(self) -> int:
        """Forwards (NFE) the request used so far; `steps` is the older name."""
        return self.steps

    @property
    def tokens_per_forward(self) -> float:
        return tokens_per_forward(self.completion_tokens, self.steps)
