"""Constrained rows in a denoising step: the left-to-right rule (docs/architecture.md).

A grammar matcher reads left to right; a diffusion model commits out of order. The rule: a
constrained row commits only the leftmost masked positions of its window (every left
neighbour already committed), as many as its algorithm would commit this step (its schedule's
k, or, in threshold mode, while the chosen token's probability under the grammar-masked
distribution is at least τ, at least one), choosing each token among those the matcher allows
after the tokens before it. The committed canvas is therefore always a prefix the matcher has
accepted; once the structure is complete only end-of-text is allowed, which ends the row.

Work split: the first position's allowed-token bitmask depends only on the prefix committed
before the step, so it is filled on the CPU while the GPU runs the forward; later positions
need the token just chosen (one small device-to-host copy per position). The masks of all rows
of a position are filled by one call into llguidance's executor (its own threads, the GIL
released once: a release per row could wait a GIL switch interval each on a busy server).
Rows without a constraint are never touched here.

A matcher that fails mid-generation (one of llguidance's per-step limits, `constraint_limits.py`)
fails its own row only, with a message naming the field and no parser internals; the other rows
commit as usual.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llnp  # not llguidance.torch: it runs torch.compile on import
import numpy as np
import torch

from .constraint_limits import first_line
from .filters import top_k_logits, top_p_logits

if TYPE_CHECKING:
    from ..sequence import Sequence

# Tokens whose text only closes a structure; preferred in the last part of the canvas.
_CLOSING_CHARS = frozenset('"}])')
_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def mask_executor() -> llguidance.LLExecutor:
    """llguidance's mask threads (made on first use; 80% of the CPUs, at most 32)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


class RowConstraint:
    """One request's matcher plus how much of its canvas is reserved for closing."""

    def __init__(
        self, matcher: llguidance.LLMatcher, max_tokens: int, field: str = "response_format"
    ) -> None:
        self.matcher = matcher
        self.field = field  # the request field the constraint came from, for errors
        # In the last quarter of the canvas the row prefers tokens that close the structure
        # (end-of-text, then `"`, `}`, `]`, then `,`), among those the grammar allows: a model that
        # has not learned to close a string or an object still finishes inside its budget.
        self.reserve = max(8, max_tokens // 4)

    def consume(self, token: int) -> bool:
        """Advance past `token`; False once the matcher is in error (see `failure`)."""
        return self.matcher.consume_token(token) and not self.matcher.is_error()

    def failure(self) -> str:
        """The row's error once its matcher failed: the request's fault (400 class), no
        parser state."""
        return (
            f"invalid request: {self.field}: the constraint could not be enforced at this point "
            f"of the output ({first_line(self.matcher.get_error())}); simplify it"
        )


class ConstraintRuntime:
    """Per-model state shared by all constrained rows: vocabulary size, stop ids, the closing
    preference vector on the device."""

    def __init__(
        self,
        tokenizer: Any,
        model_vocab: int,
        stop_ids: frozenset[int],
        eos_id: int,
        device,
        mask_vocab: int | None = None,
    ) -> None:
        self.vocab = model_vocab
        self.mask_vocab = mask_vocab or model_vocab  # llguidance's vocabulary (bitmask width)
        self.eos_id = eos_id
        self.stop_ids = sorted(stop_ids | {eos_id})
        self.device = device
        texts = tokenizer.batch_decode([[i] for i in range(min(len(tokenizer), model_vocab))])
        bonus = torch.zeros(model_vocab, dtype=torch.float32)
        for i, t in enumerate(texts):
            s = t.strip()
            if s and set(s) <= _CLOSING_CHARS:
                bonus[i] = 1e4
            elif s and set(s) <= _CLOSING_CHARS | {","}:
                bonus[i] = 5e3  # ends a number or a value, where nothing closes yet
        bonus[self.stop_ids] = 2e4
        self.closing_bonus = bonus.to(device)


@dataclass
class _Row:
    index: int  # row in the batch
    seq: Sequence
    first: int  # window position of the leftmost masked token
    budget: int  # positions it may commit this step (threshold rows: all masked ones)
    threshold: float | None
    done: bool = False


class ConstrainedStep:
    """The constrained rows of one step: masks prepared early, tokens chosen in order."""

    def __init__(self, runtime: ConstraintRuntime, seqs: list[Sequence]) -> None:
        self.rt = runtime
        self.rows: list[_Row] = []
        for i, s in enumerate(seqs):
            if s.constraint is None:
                continue
            first = s.window_width - s.masks_in_block
            if s.uses_threshold:
                budget, thr = s.masks_in_block, s.params.threshold
            elif s.rule.draws_positions:
                budget = max(1, round(s.masks_in_block * s.origin_probability()))
                thr = None
            else:
                budget, thr = min(s.transfer_count(), s.masks_in_block), None
            self.rows.append(_Row(i, s, first, budget, thr))
        self.bitmask = llnp.allocate_token_bitmask(max(1, len(self.rows)), runtime.mask_vocab)
        self.failed: dict[int, str] = {}  # batch row -> error: rows whose matcher failed
        self._slot: dict[int, int] = {}  # batch row -> its mask's row in `bitmask`
        self._filled = False

    def __bool__(self) -> bool:
        return bool(self.rows)

    def prepare(self) -> None:
        """Fill the first position's masks (CPU); call right after the forward is queued."""
        self._fill([r for r in self.rows if r.budget > 0])
        self._filled = True

    def _fill(self, rows: list[_Row]) -> None:
        self._slot = {r.index: slot for slot, r in enumerate(rows)}
        if not rows:
            return
        pairs = [(r.seq.constraint.matcher, slot) for slot, r in enumerate(rows)]
        llnp.fill_next_token_bitmask_par(mask_executor(), pairs, self.bitmask)
        for slot, r in enumerate(rows):
            if r.seq.constraint.matcher.is_error():
                self._fail(r)
            self._allow_all_stops(slot)

    def _fail(self, r: _Row) -> None:
        r.done = True
        self.failed.setdefault(r.index, r.seq.constraint.failure())

    def _allow_all_stops(self, slot: int) -> None:
        """The matcher allows "end" as the tokenizer's EOS; any stop id of the model ends."""
        words = self.bitmask.view(np.uint32)[slot]
        eos = self.rt.eos_id
        if words[eos // 32] >> np.uint32(eos % 32) & 1:
            for t in self.rt.stop_ids:
                words[t // 32] |= np.uint32(1 << (t % 32))

    def commit(self, logits: torch.Tensor, current: torch.Tensor) -> dict[int, list[int]]:
        """Choose and consume each constrained row's tokens; returns {batch row: tokens} to
        write from the row's leftmost masked position. Reads `logits` before any in-place
        change by the proposal functions."""
        out: dict[int, list[int]] = {r.index: [] for r in self.rows}
        j = 0
        while True:
            active = [r for r in self.rows if not r.done and j < r.budget]
            if (j > 0 or not self._filled) and active:
                self._fill(active)
            active = [r for r in active if not r.done]  # a row whose matcher failed is out
            if not active:
                return out
            tokens, probs = self._choose(logits, active, j)
            for slot, r in enumerate(active):
                tok, p = tokens[slot], probs[slot]
                if j > 0 and r.threshold is not None and p < r.threshold:
                    r.done = True
                    continue
                out[r.index].append(tok)
                if tok in self.rt.stop_ids:  # allowed only where the structure may end
                    r.done = True
                elif not r.seq.constraint.consume(tok):
                    self._fail(r)
            j += 1

    def _choose(
        self, logits: torch.Tensor, active: list[_Row], j: int
    ) -> tuple[list[int], list[float]]:
        dev = logits.device
        n = len(active)
        rows_t = torch.tensor([r.index for r in active], device=dev)
        pos_t = torch.tensor([r.first + j for r in active], device=dev)
        lg = logits[rows_t, pos_t].float()
        temps = [r.seq.params.temperature for r in active]
        if any(t > 0 for t in temps):
            lg = lg / torch.tensor([t if t > 0 else 1.0 for t in temps], device=dev)[:, None]
        slots = [self._slot[r.index] for r in active]
        words = torch.from_numpy(self.bitmask[slots]).to(dev)
        bits = (words[:, :, None] >> torch.arange(32, device=dev, dtype=torch.int32)) & 1
        allowed = bits.reshape(n, -1)[:, : lg.shape[1]].bool()
        if allowed.shape[1] < lg.shape[1]:  # model rows beyond the tokenizer: never allowed
            allowed = torch.nn.functional.pad(allowed, (0, lg.shape[1] - allowed.shape[1]))
        lg = lg.masked_fill(~allowed, -torch.inf)
        closing = [
            r.seq.params.max_tokens - (r.seq.block * r.seq.params.block_length + r.first + j)
            <= r.seq.constraint.reserve
            for r in active
        ]
        if any(closing):
            sel = torch.tensor([i for i, c in enumerate(closing) if c], device=dev)
            lg[sel] = lg[sel] + self.rt.closing_bonus[None, : lg.shape[1]]
        tok = lg.argmax(dim=-1)
        for slot, r in enumerate(active):
            p = r.seq.params
            if p.temperature > 0 and not closing[slot]:
                row = lg[slot]
                if p.top_p is not None and p.top_p < 1:
                    row = top_p_logits(row, p.top_p)
                if p.top_k is not None:
                    row = top_k_logits(row, p.top_k)
                tok[slot] = torch.multinomial(
                    torch.softmax(row, -1), 1, generator=r.seq.generator
                ).squeeze(-1)
        prob = torch.softmax(lg, -1).gather(-1, tok[:, None]).squeeze(-1)
        return tok.tolist(), prob.tolist()

    def write(
        self, new: torch.Tensor, current: torch.Tensor, forced: dict[int, list[int]]
    ) -> torch.Tensor:
        """Replace the constrained rows' commits in `new` [B, K] by their in-order tokens."""
        rows, cols, vals = [], [], []
        for r in self.rows:
            toks = forced.get(r.index, [])
            rows += [r.index] * len(toks)
            cols += range(r.first, r.first + len(toks))
            vals += toks
        dev = new.device
        sel = torch.tensor([r.index for r in self.rows], device=dev)
        new[sel] = current[sel]
        if vals:
            new[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = torch.tensor(
                vals, device=dev, dtype=new.dtype
            )
        return new
