"""How many tokens each step commits: LLaDA's per-block linear schedule and Dream's timesteps."""

from __future__ import annotations

import torch


def llada_block_schedule(block_masks: int, steps: int) -> list[int]:
    """The block's masks spread evenly over its steps, the remainder to the first steps."""
    base, rem = divmod(block_masks, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


class DreamSchedule:
    """Dream's `linspace(1, eps, steps + 1)` timesteps; counts computed in float32 as published."""

    def __init__(self, steps: int, eps: float = 1e-3) -> None:
        self.steps = steps
        self.timesteps = torch.linspace(1, eps, steps + 1)

    def transfer_ratio(self, i: int) -> torch.Tensor:
        t, s = self.timesteps[i], self.timesteps[i + 1]
        return 1 - s / t

    def count(self, i: int, masks_left: int) -> int:
        """Tokens to commit at step i when `masks_left` positions are still masked."""
        if i >= self.steps - 1:
            return masks_left
        return int(torch.tensor(masks_left) / 1 * self.transfer_ratio(i))

    def origin_probability(self, i: int) -> float:
        """Per-position commit probability of the `origin` algorithm at step i."""
        return 1.0 if i >= self.steps - 1 else float(self.transfer_ratio(i))
