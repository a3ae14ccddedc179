"""Structured output on DiffusionGemma's uniform-state canvas.

A grammar matcher reads left to right; a uniform-diffusion canvas is rewritten everywhere
at every step, so no position is final until the canvas ends. The rule: the row's matcher
holds the tokens already final (earlier canvases, as returned); the sampler denoises the
canvas as usual, and when it ends its argmax canvas is replaced by the constrained argmax:
left to right, each position takes the best token of the last step's logits among those the
matcher allows after the tokens before it. Once the structure is complete the first stop id
the grammar allows ends the text and the rest of the canvas is end-of-text. The returned
canvas (the one encoded into the cache for the next canvas) is therefore always a prefix the
matcher accepted, whatever the weights.

Near `max_tokens` (the row's closing reserve) tokens that close the structure are preferred,
as for the other families (`constraints.ConstraintRuntime.closing_bonus`), so a model that
never learned to stop still finishes inside its budget. Rows without a constraint never come
here, and the walk draws nothing from the row's generator: its sampling is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance.numpy as llnp  # not llguidance.torch: it runs torch.compile on import
import numpy as np
import torch

from .constraints import ConstraintRuntime, RowConstraint


@dataclass
class CanvasWalk:
    """The constrained canvas and, when the matcher failed, the row's error."""

    tokens: torch.Tensor  # [L]
    failure: str | None = None


class CanvasConstraint:
    """One constrained row's walker: its matcher (advanced canvas by canvas) and budget."""

    def __init__(
        self,
        constraint: RowConstraint,
        runtime: ConstraintRuntime,
        max_tokens: int,
        closers: tuple[int, ...] = (),
    ) -> None:
        self.constraint = constraint
        self.rt = runtime
        self.max_tokens = max_tokens
        # tokens that also close the structure (a tool format's string delimiter and key
        # separator, tools.py), preferred near max_tokens beside the runtime's
        self.closers = closers
        self.bitmask = llnp.allocate_token_bitmask(1, runtime.mask_vocab)
        self._stops: torch.Tensor | None = None

    def allowed(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """The tokens the matcher allows next, as a bool row over the model's vocabulary
        (every stop id wherever the grammar may end); None when the matcher failed."""
        matcher = self.constraint.matcher
        llnp.fill_next_token_bitmask(matcher, self.bitmask, 0)
        if matcher.is_error():
            return None
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.rt.mask_vocab]
        allowed = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, len(bits))
        allowed[:n] = torch.from_numpy(bits[:n].astype(bool))
        if allowed[self.rt.eos_id]:
            allowed[self.rt.stop_ids] = True
        return allowed.to(device)

    def walk(self, logits: torch.Tensor, start: int) -> CanvasWalk:
        """The constrained argmax of one finished canvas; `logits` [L, V] are its last step's,
        `start` the canvas's first position in the answer. Consumes the tokens it returns
        (up to `max_tokens`), so the matcher is ready for the next canvas."""
        length, vocab = logits.shape
        out = torch.argmax(logits, dim=-1)
        dev = logits.device
        if self._stops is None:
            self._stops = torch.tensor(self.rt.stop_ids, device=dev)
        bonus = self.rt.closing_bonus[:vocab].to(dev)
        if self.closers:
            bonus = bonus.clone()
            bonus[list(self.closers)] += 1e4
        for j in range(min(length, self.max_tokens - start)):
            allowed = self.allowed(vocab, dev)
            if allowed is None or not bool(allowed.any()):
                return CanvasWalk(out, self.constraint.failure())
            row = logits[j].float().masked_fill(~allowed, -torch.inf)
            if self.max_tokens - (start + j) <= self.constraint.reserve:
                row = row + bonus
            tok = int(torch.argmax(row))
            out[j] = tok
            if tok in self.rt.stop_ids:  # allowed only where the structure may end
                out[j + 1 :] = self.rt.eos_id
                return CanvasWalk(out)
            if not self.constraint.consume(tok):
                return CanvasWalk(out, self.constraint.failure())
        return CanvasWalk(out)
