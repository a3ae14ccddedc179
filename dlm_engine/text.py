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
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: frozenset[int],
        stop: tuple[str, ...],
        keep: dict[int, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # special tokens the text keeps (id -> text): a tool format's markup, which its
        # parser reads (decoding otherwise skips every special token)
        self.keep = keep or {}
        self.stop_ids = stop_ids
        self.stop = stop
        self.sent = ""
        self.token_ids: list[int] = []
        self.completion_tokens = 0
        self._seen = 0  # length of the committed prefix last looked at
        self._decoded: tuple[list[int], str] = ([], "")  # ids decoded last, and their text
        backend = getattr(tokenizer, "_tokenizer", None)  # fast tokenizers: skip the wrapper
        self._raw_decode = backend.decode if getattr(tokenizer, "is_fast", False) else None

    def update(self, prefix: list[int], canvas_complete: bool) -> TextUpdate:
        # The committed prefix only grows: an unchanged one (most steps of most rows) cannot
        # change the text, so nothing is decoded.
        if len(prefix) == self._seen and not canvas_complete:
            return TextUpdate("", False, None)
        # only the tokens added since the last look can hold the first stop token: an
        # earlier one would have finished the request
        stop_at = next(
            (i for i in range(self._seen, len(prefix)) if prefix[i] in self.stop_ids), None
        )
        self._seen = len(prefix)
        ids = prefix if stop_at is None else prefix[:stop_at]
        finished = stop_at is not None or canvas_complete
        reason = "stop" if stop_at is not None else ("length" if canvas_complete else None)
        text = self._decode(ids)
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

    def _decode(self, ids: list[int]) -> str:
        """Text of `ids`, decoding only what was added since the last call: the new tokens
        with a few before them for context, taken as the difference of two decodes that
        start at the same token (so leading-space and byte-merging rules apply alike), as
        vLLM's incremental detokenizer does. Anything else decodes the whole prefix."""
        old_ids, old_text = self._decoded
        m, n = len(old_ids), len(ids)
        if m and n > m and ids[:m] == old_ids:
            ctx = max(0, m - 4)
            before, after = self._piece(ids[ctx:m]), self._piece(ids[ctx:n])
            if after.startswith(before) and not before.endswith("\ufffd"):
                text = old_text + after[len(before) :]
                self._decoded = (list(ids), text)
                return text
        text = self._piece(ids)
        self._decoded = (list(ids), text)
        return text

    def _piece(self, ids: list[int]) -> str:
        if self.keep and not self.keep.keys().isdisjoint(ids):
            parts, run = [], []
            for t in ids:
                if t in self.keep:
                    parts += [self._plain(run), self.keep[t]]
                    run = []
                else:
                    run.append(t)
            return "".join([*parts, self._plain(run)])
        return self._plain(ids)

    def _plain(self, ids: list[int]) -> str:
        if self._raw_decode is not None:  # what decode() does for a fast tokenizer, minus
            return self._raw_decode(ids, skip_special_tokens=True)  # the conversion layers
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

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
            piece = (
                self._piece(ids[:n])
                if self.keep
                else self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            )
            if len(piece) >= len(text):
                return ids[:n]
        return ids
