"""d3LLM's multi-block decoding: several blocks of one canvas in flight at once (issue 15).

Host-side bookkeeping for one request, restated from hao-ai-lab/d3LLM's
`generate_multi_block` (LLaDA) / `_sample_multi_block` (Dream) and SGLang PR #20615's
`FullAttnMultiBlock` (see `reference.d3llm_multi_block_generate`). Before each step, a block
whose predecessor has decoded at least `decoded_token_threshold` of its tokens becomes
*activated*, and a new block is added once the last block's progress reaches
`block_add_threshold` (or it is complete). The step may commit any mask up to the end of the
rightmost block in flight; the first activated block that still holds masks must get at least
one commit. Mask counts come from the host copy of the canvas the engine already makes each
step, so this adds no device synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling_params import Acceleration


@dataclass
class Block:
    start: int  # canvas-relative
    end: int
    masks: int
    active: bool

    @property
    def progress(self) -> float:
        return 1 - self.masks / (self.end - self.start)


class MultiBlockState:
    """The blocks of one request that have been added so far (d3LLM's `block_states`)."""

    def __init__(self, canvas_len: int, block: int, accel: Acceleration) -> None:
        self.block = block
        self.num_blocks = canvas_len // block
        self.add_at = accel.block_add_threshold
        self.activate_at = accel.decoded_token_threshold
        self.cap = accel.max_active_blocks
        # block 1 follows the prompt (progress 1.0)
        self.blocks = [Block(0, block, block, self.activate_at <= 1.0)]
        self.prepare()

    def _progress_before(self, i: int) -> float:
        return 1.0 if i == 0 else self.blocks[i - 1].progress

    def prepare(self) -> None:
        """Activation, then at most one new block: the top of d3LLM's loop."""
        for i, b in enumerate(self.blocks):
            if not b.active and self._progress_before(i) >= self.activate_at:
                b.active = True
        if len(self.blocks) >= self.num_blocks:
            return
        last = self.blocks[-1]
        in_flight = sum(1 for b in self.blocks if b.masks > 0)
        if self.cap is not None and in_flight >= self.cap:
            return
        if last.progress >= self.add_at or last.masks == 0:
            start = last.end
            self.blocks.append(
                Block(start, start + self.block, self.block, last.progress >= self.activate_at)
            )

    def window(self) -> tuple[int, int]:
        """Canvas-relative [lo, hi): from the first block with masks to the rightmost block
        that is activated or still holds masks."""
        hi = max(b.end for b in self.blocks if b.active or b.masks > 0)
        lo = next((b.start for b in self.blocks if b.masks > 0), hi)
        return lo, hi

    def forced(self) -> tuple[int, int] | None:
        """Canvas-relative span of the first activated block that still holds masks."""
        b = next((b for b in self.blocks if b.active and b.masks > 0), None)
        return None if b is None else (b.start, b.end)

    def absorb(self, canvas: list[int], mask_id: int) -> None:
        """Recount each block's masks from the canvas after a step, then prepare the next."""
        for b in self.blocks:
            b.masks = sum(1 for t in canvas[b.start : b.end] if t == mask_id)
        self.prepare()

    @property
    def in_flight(self) -> int:
        return sum(1 for b in self.blocks if b.masks > 0)
