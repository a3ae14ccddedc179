"""What responses carry beyond OpenAI's fields, and the finish reasons, written once."""

from __future__ import annotations

# Finish reasons the engine reports; OpenAI knows the first two (`abort` = cancelled/shut down).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_TOOL_CALLS = "tool_calls"  # the answer is tool calls (`tool_calls` output)
OPENAI_FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_TOOL_CALLS)

# Extra fields of OpenAI's `usage` object (non-streaming bodies and the include_usage chunk).
USAGE_EXTRAS: dict[str, str] = {
    "forwards": "forwards (NFE, denoising steps) the call used, summed over its choices",
    "tokens_per_forward": "`completion_tokens / forwards`: how many tokens a forward committed "
    "on average (1 for one token per step; more with fewer steps or `threshold`)",
}
# Extra fields of a streamed choice in `stream_mode: denoise`.
CHUNK_EXTRAS: dict[str, str] = {
    "canvas": "the whole canvas after this step (token strings, null = still masked)",
    "steps": "forwards used so far",
}

# one token's entry in the `logprobs` output (a JSON list per response); the proxy
# turns it into OpenAI's per-token object and keeps `step` as an extra field.
LOGPROB_FIELDS: dict[str, str] = {
    "token_id": "the token's id",
    "token": "the token's text",
    "bytes": "the token's UTF-8 bytes (a list of integers)",
    "logprob": "log-probability of the token under the model's distribution at its position, "
    "in the step that committed it (logits / temperature; before top-p / top-k, EOS "
    "suppression and grammar masks; temperature 0 reads as 1)",
    "step": "the forward (1 = the request's first) that committed the token",
    "top_logprobs": "the most likely tokens at that position in that step, most likely first "
    "(`token_id`, `token`, `bytes`, `logprob`), as many as the request asked",
}

# Chat roles the engine's chat templates know; OpenAI's newer `developer` is `system`.
# `tool`: a tool's result, with `tool_call_id`; an assistant message may carry
# `tool_calls` (OpenAI's shape) instead of content.
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}


def tokens_per_forward(completion_tokens: int, forwards: int) -> float:
    """Tokens committed per forward, rounded for display; 0 before the first forward."""
    return round(completion_tokens / forwards, 4) if forwards else 0.0
