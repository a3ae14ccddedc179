"""One request's output state: what the engine builds its outputs from between admission and
the final output, kept as one object so that admission, every step and every way a request
ends create, read and drop it together."""

from __future__ import annotations

from dataclasses import dataclass

from .decoding.logprobs import LogprobStream
from .text import StableText
from .tools import ToolCallText


@dataclass
class OutputState:
    """A request's stable text, and for requests that ask for them its tool-call text and its
    logprob stream."""

    text: StableText
    tools: ToolCallText | None = None  # requests with tools
    logprobs: LogprobStream | None = None  # requests with `logprobs`

    @property
    def sent(self) -> str:
        """The text sent so far: the content (before any tool call) for requests with tools."""
        return self.text.sent if self.tools is None else self.tools.sent
