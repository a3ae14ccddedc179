"""Which masked positions each row commits this step: one vectorised op for all rows."""

from __future__ import annotations

import torch


def select_transfers(
    confidence: torch.Tensor,
    selectable: torch.Tensor,
    k: torch.Tensor,
    threshold: torch.Tensor,
) -> torch.Tensor:
    """Bool [B, K]: per row the `k` most confident selectable positions, or, where
    `threshold` is set (not NaN), every selectable position with confidence ≥ τ and at
    least the most confident one."""
    b, width = confidence.shape
    conf = confidence.masked_fill(~selectable, -torch.inf)
    order = conf.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(width, device=conf.device).expand(b, width)
    )
    by_rank = ranks < k[:, None]
    use_threshold = ~torch.isnan(threshold)
    by_threshold = (conf >= threshold[:, None].to(conf.dtype)) | (ranks == 0)
    return torch.where(use_threshold[:, None], by_threshold, by_rank) & selectable
