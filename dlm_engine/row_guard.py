"""Per-row fault isolation inside one denoising step.

A step runs many requests' rows together; one row's values must never end the others. Two
kinds of fault are caught per row, without an extra host sync:

- an exception in the row's own policy code (the per-row loops of proposals and sampling):
  recorded on the host, the row keeps its tokens unchanged this step;
- non-finite numbers (NaN / inf confidences or sampling probabilities, or the mask token
  proposed where a commit is due): folded into a device bool `ok[B]` that rides along the
  step's one device-to-host copy.

Rows that fail are ended with an error by the engine; the others commit as usual.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FAULT_MESSAGE = "internal error: this request's decoding step failed"


class RowGuard:
    """Device `ok` flags and host error messages for the rows of one step."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.ok = torch.ones(rows, dtype=torch.bool, device=device)
        self.errors: dict[int, str] = {}

    def run(self, row: int, fn: Callable[[], None]) -> None:
        """Run one row's policy code; an exception fails that row only."""
        if row in self.errors:
            return
        try:
            fn()
        except Exception as exc:
            self.errors[row] = f"{FAULT_MESSAGE} ({type(exc).__name__}: {exc})"

    def require_finite(self, row: int, values: torch.Tensor) -> None:
        """Fail `row` (on the device, no sync) unless every value is finite."""
        self.ok[row] &= torch.isfinite(values).all()

    def check_step(
        self,
        conf: torch.Tensor,
        x0: torch.Tensor,
        selectable: torch.Tensor,
        chosen: torch.Tensor,
        mask_id: int,
    ) -> torch.Tensor:
        """`ok` after the vectorised checks: finite confidences where a commit is possible,
        and no commit of the mask token itself."""
        finite = (torch.isfinite(conf) | ~selectable).all(dim=1)
        no_mask = ~(chosen & (x0 == mask_id)).any(dim=1)
        return self.ok & finite & no_mask

    def messages(self, ok_host: list[bool]) -> dict[int, str]:
        """Rows that failed this step and why (after the one host copy)."""
        failed = dict(self.errors)
        for i, good in enumerate(ok_host):
            if not good and i not in failed:
                failed[i] = (
                    f"{FAULT_MESSAGE} (non-finite values; the other requests were unaffected)"
                )
        return failed
