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

from ..reference import top_k_logits, top_p_logits


@dataclass
class RowDecode:
    """One row's decoding settings for this step."""

    width: int  # valid positions in the row's window
    algorithm: str
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


def _alt_confidence(conf: torch.Tensor, probs: torch.Tensor, rows: list[RowDecode]) -> torch.Tensor:
    """Swap in margin / negative-entropy confidences for the rows whose algorithm asks."""
    for alg, fn in (("topk_margin", _margin), ("entropy", _neg_entropy)):
        idx = [i for i, r in enumerate(rows) if r.algorithm == alg]
        if idx:
            sel = torch.tensor(idx, device=conf.device)
            conf[sel] = fn(probs[sel]).to(conf.dtype)
    return conf


def propose(
    family: str, logits: torch.Tensor, rows: list[RowDecode], eos_id: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B, K] and confidences [B, K] for every window position of every row.

    The mask token is never proposed (committing it would leave the position masked);
    confidences still come from the unmodified distribution, as published. `logits` may be
    modified in place."""
    suppress = [i for i, r in enumerate(rows) if r.suppress_eos]
    if suppress:
        logits[torch.tensor(suppress, device=logits.device), :, eos_id] = -torch.inf
    if family == "llada":
        return _propose_llada(logits, rows, mask_id)
    return _propose_dream(logits, rows, mask_id)


def _propose_llada(
    logits: torch.Tensor, rows: list[RowDecode], mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = F.softmax(logits.to(torch.float64), dim=-1)
    logits[..., mask_id] = -torch.inf
    x0 = logits.argmax(dim=-1)
    for i, r in enumerate(rows):
        if r.temperature > 0:
            lg = logits[i, : r.width].to(torch.float64)
            u = torch.rand(lg.shape, dtype=torch.float64, device=lg.device, generator=r.generator)
            x0[i, : r.width] = (lg.exp() / (-torch.log(u)) ** r.temperature).argmax(dim=-1)
    conf = torch.gather(probs, -1, x0[..., None]).squeeze(-1)
    for i, r in enumerate(rows):
        if r.algorithm == "random":
            conf[i, : r.width] = torch.rand(
                r.width, dtype=torch.float64, device=conf.device, generator=r.generator
            )
    return x0, _alt_confidence(conf, probs, rows)


def _propose_dream(
    logits: torch.Tensor, rows: list[RowDecode], mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    for i, r in enumerate(rows):
        if r.temperature > 0 or r.top_p is not None or r.top_k is not None:
            lg = logits[i]
            if r.temperature > 0:
                lg = lg / r.temperature
            if r.top_p is not None and r.top_p < 1:
                lg = top_p_logits(lg, r.top_p)
            if r.top_k is not None:
                lg = top_k_logits(lg, r.top_k)
            logits[i] = lg
    probs = torch.softmax(logits, dim=-1)
    conf = _alt_confidence(
        torch.zeros(probs.shape[:-1], dtype=probs.dtype, device=probs.device), probs, rows
    )
    probs[..., mask_id] = 0
    best, x0 = probs.max(dim=-1)
    for i, r in enumerate(rows):
        if r.temperature > 0:
            p = probs[i, : r.width].float()
            x0[i, : r.width] = torch.multinomial(p, 1, generator=r.generator).squeeze(-1)
            best[i, : r.width] = torch.gather(
                probs[i, : r.width], -1, x0[i, : r.width, None]
            ).squeeze(-1)
    keep = torch.tensor(
        [r.algorithm not in ("topk_margin", "entropy") for r in rows], device=conf.device
    )
    return x0, torch.where(keep[:, None], best, conf)
