"""Small host values onto the device without making the host wait.

`torch.tensor(values, device=cuda)` copies from pageable memory and synchronises the stream:
made after a step's forward is queued, it stalls the host until the forward has finished, and
every kernel launched after it runs behind it. Staged through pinned (page-locked) memory the
copy is queued on the stream like a kernel and the host goes on, so a step can build its
decoding tensors while its forward runs (`ModelRunner.step`). PyTorch's pinned-memory cache
keeps the staging buffer alive until its copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`values` (a list, or a CPU tensor) as a tensor on `device`, queued without a wait."""
    if isinstance(values, torch.Tensor):
        host = values if dtype is None else values.to(dtype)
        if device.type != "cuda":
            return host.to(device)
        return host.pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
