"""Per-position proposals (token and confidence) for every row of a step, in each family's math.

LLaDA (`generate.py`): argmax of Gumbel-noised logits (float64), confidence = float64 softmax
probability of the proposal. Dream (`sample_tokens`): temperature / top-p / top-k on the
logits, softmax in the logits' dtype, max (or a sample) and its probability; `topk_margin`
and `entropy` replace the confidence. Random draws come from each row's own generator, sized
by the row's own window, so batching never changes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models import Family, family_of
from ..row_guard import RowGuard
from ..staging import to_device
from .filters import top_k_logits, top_p_logits

# how a row's positions are scored before its commit rule ranks them (a strategy's
# `confidence`): the proposal's probability, the top-two margin, the negative entropy, or
# uniform random draws
PROBABILITY, MARGIN, NEG_ENTROPY, RANDOM = "probability", "margin", "neg_entropy", "random"


@dataclass
class RowDecode:
    """One row's decoding settings for this step."""

    width: int  # valid positions in the row's window
    confidence: str  # how its positions are scored: its strategy's `confidence`
    temperature: float
    top_p: float | None
    top_k: int | None
    suppress_eos: bool
    generator: torch.Generator | None


def _neg_entropy(probs: torch.Tensor) -> torch.Tensor:
    return torch.sum(probs * torch.log(probs + 1e-10), dim=-1)


def _margin(probs: torch.Tensor) -> torch.Tensor:
    top2 = torch.topk(probs, 2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


@dataclass
class RowIndex:
    """Device index tensors of the rows that need special handling (staged: built while the
    forward runs, no host wait)."""

    suppress: torch.Tensor | None
    margin: torch.Tensor | None
    entropy: torch.Tensor | None
    keep_best: torch.Tensor  # rows whose confidence is the proposal's probability

    @classmethod
    def build(cls, rows: list[RowDecode], device: torch.device) -> RowIndex:
        def idx(pred) -> torch.Tensor | None:
            sel = [i for i, r in enumerate(rows) if pred(r)]
            return to_device(sel, device) if sel else None

        return cls(
            suppress=idx(lambda r: r.suppress_eos),
            margin=idx(lambda r: r.confidence == MARGIN),
            entropy=idx(lambda r: r.confidence == NEG_ENTROPY),
            keep_best=to_device([r.confidence not in (MARGIN, NEG_ENTROPY) for r in rows], device),
        )


def _alt_confidence(conf: torch.Tensor, probs: torch.Tensor, index: RowIndex) -> torch.Tensor:
    """Swap in margin / negative-entropy confidences for the rows whose strategy asks."""
    for sel, fn in ((index.margin, _margin), (index.entropy, _neg_entropy)):
        if sel is not None:
            conf[sel] = fn(probs[sel]).to(conf.dtype)
    return conf


def propose(
    family: Family | str,
    logits: torch.Tensor,
    rows: list[RowDecode],
    index: RowIndex,
    eos_id: int,
    mask_id: int,
    guard: RowGuard | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, K] and confidences [B, K] for every window position of every row.

    The mask token is never proposed (committing it would leave the position masked);
    confidences still come from the unmodified distribution, as published. `logits` may be
    modified in place. With a `guard`, a row whose own code raises fails alone."""
    guard = guard or RowGuard(len(rows), logits.device)
    if index.suppress is not None:  # index_fill_: a scalar put by index would wait for the GPU
        logits[:, :, eos_id].index_fill_(0, index.suppress, -torch.inf)
    if family_of(family).gumbel_proposals:
        return _propose_llada(logits, rows, index, mask_id, guard)
    return _propose_dream(logits, rows, index, mask_id, guard)


def _gumbel_argmax(lg: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """LLaDA's `add_gumbel_noise` + argmax. 0/0 (a -inf logit over an underflowed noise
    term, common at high temperature) is the one NaN it can make: such a position is never
    the proposal, so it counts as 0, the smallest value."""
    u = torch.rand(lg.shape, dtype=torch.float64, device=lg.device, generator=generator)
    noised = lg.exp() / (-torch.log(u)) ** temperature
    return torch.nan_to_num(noised, nan=0.0).argmax(dim=-1)


def _propose_llada(
    logits: torch.Tensor, rows: list[RowDecode], index: RowIndex, mask_id: int, guard: RowGuard
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = F.softmax(logits.to(torch.float64), dim=-1)
    logits[..., mask_id] = -torch.inf
    x0 = logits.argmax(dim=-1)
    for i, r in enumerate(rows):
        if r.temperature > 0:

            def sample(i: int = i, r: RowDecode = r) -> None:
                lg = logits[i, : r.width].to(torch.float64)
                x0[i, : r.width] = _gumbel_argmax(lg, r.temperature, r.generator)

            guard.run(i, sample)
    conf = torch.gather(probs, -1, x0[..., None]).squeeze(-1)
    for i, r in enumerate(rows):
        if r.confidence == RANDOM:
            conf[i, : r.width] = torch.rand(
                r.width, dtype=torch.float64, device=conf.device, generator=r.generator
            )
    return x0, _alt_confidence(conf, probs, index)


def _propose_dream(
    logits: torch.Tensor, rows: list[RowDecode], index: RowIndex, mask_id: int, guard: RowGuard
) -> tuple[torch.Tensor, torch.Tensor]:
    for i, r in enumerate(rows):
        if r.temperature > 0 or r.top_p is not None or r.top_k is not None:

            def warp(i: int = i, r: RowDecode = r) -> None:
                lg = logits[i]
                if r.temperature > 0:
                    lg = lg / r.temperature
                if r.top_p is not None and r.top_p < 1:
                    lg = top_p_logits(lg, r.top_p)
                if r.top_k is not None:
                    lg = top_k_logits(lg, r.top_k)
                logits[i] = lg

            guard.run(i, warp)
    probs = torch.softmax(logits, dim=-1)
    conf = _alt_confidence(
        torch.zeros(probs.shape[:-1], dtype=probs.dtype, device=probs.device), probs, index
    )
    probs[..., mask_id] = 0
    best, x0 = probs.max(dim=-1)
    for i, r in enumerate(rows):
        if r.temperature > 0:

            def sample(i: int = i, r: RowDecode = r) -> None:
                p = probs[i, : r.width].float()
                guard.require_finite(i, p)
                x0[i, : r.width] = _multinomial(p, r.generator)
                best[i, : r.width] = torch.gather(
                    probs[i, : r.width], -1, x0[i, : r.width, None]
                ).squeeze(-1)

            guard.run(i, sample)
    return x0, torch.where(index.keep_best[:, None], best, conf)


def safe_probabilities(p: torch.Tensor) -> torch.Tensor:
    """`p` with non-finite or negative entries zeroed and all-zero rows made one-hot, so
    `torch.multinomial` never sees an invalid row: on CUDA that is a device-side assert that
    ends the process. A row this changes is failed by the caller's finiteness check."""
    p = torch.where(torch.isfinite(p) & (p > 0), p, torch.zeros_like(p))
    empty = p.sum(dim=-1, keepdim=True) <= 0
    first = torch.zeros_like(p)
    first[..., 0] = 1
    return torch.where(empty, first, p)


def _multinomial(p: torch.Tensor, generator) -> torch.Tensor:
    return torch.multinomial(safe_probabilities(p), 1, generator=generator).squeeze(-1)
