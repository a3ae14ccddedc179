"""Log-probabilities of committed tokens, for the rows that ask (`logprobs` key).

A diffusion model commits a position in some step; the token's log-probability is that of the
model's distribution at that position in that step: `log_softmax(logits / T)` with the row's
temperature T (T = 0, greedy, reads as 1), taken before anything edits the logits (EOS
suppression, the mask token's exclusion, top-p / top-k, grammar masks). Classifier-free
guidance rows use the guided logits, which are the distribution they sample from.

Cost: nothing for rows that did not ask. For the rows that did, a copy of their window logits,
a float32 log-normaliser per position, a top-N (N = the largest request among them, at most 20)
and one extra small device-to-host copy per step, after the step's own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..staging import to_device

if TYPE_CHECKING:
    from ..sequence import Sequence


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its id, log-probability, the step (1 = the request's first
    forward) that committed it, and the most likely alternatives then, most likely first."""

    token_id: int
    logprob: float
    step: int
    top: tuple[tuple[int, float], ...] = ()


class LogprobStep:
    """The rows of one step that record log-probabilities (index tensors staged: built while
    the forward runs, no host wait)."""

    def __init__(self, seqs: list[Sequence], device: torch.device) -> None:
        self.rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        self.seqs = [seqs[i] for i in self.rows]
        self.top_n = max((s.params.logprobs or 0 for s in self.seqs), default=0)
        self.sel = to_device(self.rows, device)
        temps = [s.params.temperature if s.params.temperature > 0 else 1.0 for s in self.seqs]
        self.inv_temp = 1.0 / to_device(temps, device, torch.float32)
        self._logits: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None

    @classmethod
    def build(cls, seqs: list[Sequence], device: torch.device) -> LogprobStep | None:
        """None when no row of the step asked (the step then does nothing more)."""
        if all(s.params.logprobs is None for s in seqs):
            return None
        return cls(seqs, device)

    def capture(self, logits: torch.Tensor) -> None:
        """Keep the asking rows' logits and log-normalisers; call before anything edits
        `logits`. Float32 normalisers one row at a time, so a wide window (Dream's default
        block is the whole canvas) never holds more than one row's float copy."""
        self._logits = logits[self.sel]  # a copy: the step edits `logits` in place later
        self._lse = torch.stack(
            [
                torch.logsumexp(self._logits[r].float() * self.inv_temp[r], dim=-1)
                for r in range(len(self.rows))
            ]
        )

    def record(
        self, new: torch.Tensor, current: torch.Tensor, ok: torch.Tensor, mask_id: int
    ) -> None:
        """Store each newly committed token's entry on its `Sequence` (by canvas position)."""
        assert self._logits is not None, "capture() first"
        lg, lse, self._logits = self._logits, self._lse, None
        scale = self.inv_temp[:, None]
        tokens = new[self.sel]
        chosen = lg.gather(-1, tokens[..., None]).squeeze(-1).float() * scale - lse
        committed = (current[self.sel] == mask_id) & (tokens != mask_id) & ok[self.sel, None]
        parts = [tokens, chosen, committed]
        if self.top_n:  # T > 0 keeps the order of the logits: the top of lg is the top of p
            top_v, top_i = lg.topk(self.top_n, dim=-1)
            parts += [top_i, top_v.float() * scale[..., None] - lse[..., None]]
        width = tokens.shape[1]
        host = torch.cat(
            [p.to(torch.float64).reshape(len(self.rows), width, -1) for p in parts], dim=-1
        ).cpu()
        for r, seq in enumerate(self.seqs):
            n = seq.params.logprobs or 0
            offset = seq.window_start - seq.prompt_len
            step = seq.forwards + 1  # `absorb` counts this forward after the step
            for j in range(min(width, seq.window_width)):
                row = host[r, j].tolist()
                if not row[2]:
                    continue
                top: tuple[tuple[int, float], ...] = ()
                if n:
                    ids, vals = row[3 : 3 + self.top_n], row[3 + self.top_n :]
                    top = tuple((int(ids[k]), vals[k]) for k in range(n))
                seq.logprobs[offset + j] = TokenLogprob(int(row[0]), row[1], step, top)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (every byte as a printable character), inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


class TokenTexts:
    """Each token's text and UTF-8 bytes, as OpenAI reports them (cached per id). A token that
    holds part of a character decodes to U+FFFD; its bytes then come from the tokenizer's own
    byte-level (GPT-2) or byte-fallback (`<0x..>`) spelling."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._read(token_id)
        return hit

    def _read(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        text = tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        data = text.encode("utf-8")
        if "\ufffd" in text:
            raw = tok.convert_ids_to_tokens(token_id) or ""
            if raw and all(c in _BYTE_DECODER for c in raw):
                data = bytes(_BYTE_DECODER[c] for c in raw)
            elif len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
                data = bytes([int(raw[3:5], 16)])
        return text, list(data)

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, data = self(token_id)
        return {"token_id": token_id, "token": text, "bytes": data, "logprob": logprob}


class LogprobStream:
    """One request's logprob entries, released with its text: an output carries the entries
    of the completion tokens its stable text newly covers (all of them at the end)."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
        self.sent = 0  # completion tokens whose entries went out

    def release(
        self, seq: Sequence, token_ids: list[int], sent_text: str, finished: bool
    ) -> list[dict[str, Any]]:
        covered = len(token_ids) if finished else self._covered(token_ids, sent_text)
        out = []
        for pos in range(self.sent, covered):
            lp = seq.logprobs.get(pos)
            if lp is None:  # committed before the request asked: never happens today
                continue
            entry = self.texts.entry(lp.token_id, lp.logprob)
            entry["step"] = lp.step
            entry["top_logprobs"] = [self.texts.entry(i, v) for i, v in lp.top]
            out.append(entry)
        self.sent = max(self.sent, covered)
        return out

    def _covered(self, token_ids: list[int], sent_text: str) -> int:
        """The most tokens whose decoded text lies within the released text."""
        decode = self.texts.tokenizer.decode
        n = self.sent
        while n < len(token_ids):
            text = decode(
                token_ids[: n + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False
            )
            if len(text) > len(sent_text):
                break
            n += 1
        return n
