"""Where in its block a sub-block row may commit this step (Fast-dLLM v2's `generate()`).

Fast-dLLM v2 decodes a block of `block` tokens in sub-blocks of `sub` tokens, in order: each
step commits only inside the first sub-block (aligned to the block's start) that still holds a
mask. Before that, a block whose first position is masked gets it alone: upstream appends the
argmax of the finished block's last position (with token shift: the logits the engine reads
for the new block's first position) before it decodes the block.
"""

from __future__ import annotations


def commit_span(
    canvas: list[int],
    *,
    prompt_len: int,
    block_start: int,
    window_start: int,
    block: int,
    sub: int,
    mask_id: int,
) -> tuple[int, int] | None:
    """Window-relative [lo, hi) a step may commit, or None when the block holds no mask.

    `canvas` holds the positions after the prompt (`prompt_len` of them come first); the
    window is the block's decoded part, [window_start, block_start + block)."""
    end = block_start + block
    first = next((p for p in range(window_start, end) if canvas[p - prompt_len] == mask_id), None)
    if first is None:
        return None
    if first == block_start and block_start > 0:
        return 0, 1  # the block's first token, from the last block's final position
    lo = block_start + (first - block_start) // sub * sub
    hi = min(lo + sub, end)
    return max(lo, window_start) - window_start, hi - window_start
