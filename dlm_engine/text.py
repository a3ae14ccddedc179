"""Stable streamed text: what a request may show, derived from its committed prefix.

Only text that can no longer change is released: the committed prefix decoded, cut at the
first end-of-text / end-of-turn token or stop string, holding back an incomplete character
and any tail that could still grow into a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass
class TextUpdate:
    delta: str
    finished: bool
    finish_reason: str | None


class StableText:
    """Tracks one request's released text; `update` returns only what is new."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop_ids: frozenset[int], stop: tuple[str, ...]
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.stop = stop
        self.sent = ""
        self.token_ids: list[int] = []
        self.completion_tokens = 0

    def update(self, prefix: list[int], canvas_complete: bool) -> TextUpdate:
        stop_at = next((i for i, t in enumerate(prefix) if t in self.stop_ids), None)
        ids = prefix if stop_at is None else prefix[:stop_at]
        finished = stop_at is not None or canvas_complete
        reason = "stop" if stop_at is not None else ("length" if canvas_complete else None)
        text = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, finished, reason = text[:cut], True, "stop"
        self.token_ids = ids
        self.completion_tokens = len(ids) + (1 if stop_at is not None else 0)
        if cut >= 0:  # tokens behind a stop string are not part of the completion
            self.token_ids = self._ids_covering(ids, text)
            self.completion_tokens = len(self.token_ids)
        if not finished:
            text = self._hold_back(text)
        if not text.startswith(self.sent):
            return TextUpdate("", finished, reason)
        delta = text[len(self.sent) :]
        self.sent = text
        return TextUpdate(delta, finished, reason)

    def _hold_back(self, text: str) -> str:
        """Drop a trailing partial character and any suffix that begins a stop string."""
        text = text.rstrip("\ufffd")
        keep = len(text)
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = min(keep, len(text) - n)
                    break
        return text[:keep]

    def _ids_covering(self, ids: list[int], text: str) -> list[int]:
        """The shortest token prefix whose text reaches `text` (the completion before a stop string)."""
        for n in range(len(ids) + 1):
            if len(self.tokenizer.decode(ids[:n], skip_special_tokens=True)) >= len(text):
                return ids[:n]
        return ids
