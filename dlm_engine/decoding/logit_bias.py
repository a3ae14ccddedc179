"""OpenAI's `logit_bias` in a denoising step: a row's biases added to its window logits.

A diffusion step proposes a token at every masked position from that position's logits, so a
bias honours OpenAI's meaning exactly: it is added to the logits of every position of the
row's window in every step, before temperature, top-p / top-k, EOS suppression, grammar masks
and the commit rule read them. The rows of a step that carry biases are scattered in at once
from (row, token, bias) index tensors staged while the forward runs (no host wait); a step
without biased rows does nothing.

DiffusionGemma's sampler adds them at the same point: to each step's logits over the canvas,
before its temperature schedule, sampling, entropy-bound acceptance, adaptive stopping,
self-conditioning and the constrained walk (as a `logits_processor` given to transformers'
`generate` would); its logprobs too stay the model's own distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import InvalidRequestError
from ..staging import to_device

if TYPE_CHECKING:
    from ..sequence import Sequence

Biases = tuple[tuple[int, float], ...]


def check_vocab(biases: Biases | None, vocab: int) -> None:
    """Every biased id is a token of the model (else a 400 naming `logit_bias`)."""
    for token, _ in biases or ():
        if token >= vocab:
            raise InvalidRequestError("logit_bias", f"token id {token} outside [0, {vocab})")


class LogitBiasStep:
    """The biased rows of one step as flat (row, token, bias) tensors on the device."""

    def __init__(self, rows: list[int], tokens: list[int], values: list[float], device) -> None:
        self.rows = to_device(rows, device)
        self.tokens = to_device(tokens, device)
        self.values = to_device(values, device, torch.float32)

    @classmethod
    def build(cls, seqs: list[Sequence], device: torch.device) -> LogitBiasStep | None:
        """None when no row of the step has a bias."""
        return cls.of_rows([s.params.logit_bias for s in seqs], device)

    @classmethod
    def of_rows(cls, biases: list[Biases | None], device: torch.device) -> LogitBiasStep | None:
        """The step of rows with these biases (row i: `biases[i]`); None when none has one.
        DiffusionGemma rows stage theirs once, as a step of one row (uniform_diffusion.py)."""
        rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for i, row_biases in enumerate(biases):
            for token, bias in row_biases or ():
                rows.append(i)
                tokens.append(token)
                values.append(bias)
        return cls(rows, tokens, values, device) if rows else None

    def apply(self, logits: torch.Tensor) -> None:
        """Add the biases to `logits` [rows, width, vocab] in place, at every position.

        A (row, token) pair occurs once (a request's biases are a map), so the indexed
        write never loses an addition."""
        picked = logits[self.rows, :, self.tokens]  # [entries, width]
        logits[self.rows, :, self.tokens] = picked + self.values[:, None].to(logits.dtype)
