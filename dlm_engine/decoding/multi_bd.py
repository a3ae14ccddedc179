"""Diffulex's Multi-Block Diffusion (`multi_bd`) for block-diffusion rows: the running set.

Host-side bookkeeping of one request, restated from SJTU-DENG-Lab/Diffulex (`DllmReq.step` /
`postprocess`, `DllmBlock`, `DllmBlockBuffer`; the plain loop and what was read is
`dlm_lab.reference_block.multi_bd_generate`). A row's step query is its running set: up to
`buffer_size` consecutive blocks, refined in one forward with block-causal visibility (a
later block sees the earlier running blocks' current tokens, masks included), in the same
ragged block group as single-block rows (dlm_engine/ragged.py: each query's key limit is its
own block's end).

Before each step at most one block enters: the next one when the running set is empty, or
when the last running block's progress is >= `add_block_threshold` and fewer than
`buffer_size` blocks occupy the buffer (a completed front block keeps its place for the one
step in which upstream stores its keys). Nothing enters past the canvas's last block or after
a stop id was committed. A step whose running blocks hold no mask only stores keys upstream;
it has no forward here (`_advance` runs its bookkeeping at once). Mask counts come from the
host copy of the canvas the engine already makes each step: no device synchronisation.

The KV cache stays exact: keys are final only once computed from final tokens, so a row's
`kv_upto` moves to the first block that still held a mask when it was fed (`absorb`); a
completed block is fed once more, with its final tokens, in the row's next step, exactly as a
single-block row's finished block is.
"""

from __future__ import annotations

from ..block_diffusion import BlockLayout


class MultiBDState:
    """The running set of one request: blocks [front, last] (absolute block indices)."""

    def __init__(
        self,
        layout: BlockLayout,
        *,
        buffer_size: int,
        add_block_threshold: float,
        semi_complete_threshold: float,
        stop_ids: frozenset[int],
    ) -> None:
        self.layout = layout
        self.size = layout.block
        self.buffer = buffer_size
        self.add_at = add_block_threshold
        self.semi = semi_complete_threshold
        self.stop_ids = stop_ids
        self.first = layout.first_block
        self.final = layout.num_blocks - 1  # the block holding prompt + max_tokens - 1
        lo, hi = layout.window(self.first)
        self.masks = {self.first: hi - lo}  # masks per block that entered
        self.front = self.last = self.first
        self.stored = 0  # front blocks complete, their keys stored this step (TO_CACHE)
        self.ended = False  # no block may enter: a stop id was committed
        self.done = False
        self._advance()  # the first step's entry: the first block may admit the next

    # ---- what the next step feeds and how it commits ------------------------------------
    def window(self) -> tuple[int, int]:
        """Absolute [start, end) of the blocks this step samples (the running set less the
        completed front blocks being stored); the prompt's tail is not part of it."""
        b = self.front + self.stored
        return max(self.layout.prompt_len, b * self.size), (self.last + 1) * self.size

    def forced(self) -> tuple[bool, ...]:
        """Per block of the window: forced to commit at least one mask (the sequence's first
        block, or its predecessor's progress >= semi_complete_threshold)."""
        return tuple(
            b == 0 or self._progress(b - 1) >= self.semi
            for b in range(self.front + self.stored, self.last + 1)
        )

    def window_masks(self) -> int:
        return sum(self.masks[b] for b in range(self.front + self.stored, self.last + 1))

    # ---- after a step ----------------------------------------------------------------------
    def absorb(self, canvas: list[int], mask_id: int, kv_upto: int) -> int:
        """Recount the window's masks from the canvas after a step, run upstream's
        postprocess and the next step's entry; returns the row's new `kv_upto`: the first
        block fed this step that still held a mask (its keys and everything after are not
        final), or the end of the fed span."""
        fed_end = (self.last + 1) * self.size
        new_upto = fed_end
        for b in range(kv_upto // self.size, self.last + 1):
            if self.masks.get(b, 0) > 0:  # prompt blocks hold none
                new_upto = b * self.size
                break
        p = self.layout.prompt_len
        lo, hi = self.window()
        if any(t in self.stop_ids for t in canvas[lo - p : hi - p]):
            self.ended = True
        for b in range(self.front + self.stored, self.last + 1):
            s, e = self.layout.window(b)
            self.masks[b] = sum(1 for t in canvas[s - p : e - p] if t == mask_id)
        self._postprocess()
        if not self.done:
            self._advance()
        return new_upto

    def _progress(self, b: int) -> float:
        """DllmBlock.progress: decoded positions / block, prompt tokens counting as decoded."""
        return (self.size - self.masks.get(b, 0)) / self.size

    def _postprocess(self) -> None:
        """Front blocks stored this step leave; completed front blocks are stored next step;
        the request is done once nothing may enter and every running block is complete."""
        self.front += self.stored
        self.stored = 0
        while self.front + self.stored <= self.last and self.masks[self.front + self.stored] == 0:
            self.stored += 1
        closed = self.ended or self.last == self.final
        if closed and all(self.masks[b] == 0 for b in range(self.front, self.last + 1)):
            self.done = True

    def _enter(self) -> None:
        """DllmReq.step: at most one block enters the running set."""
        if self.last == self.final or self.ended:
            return
        occupied = self.last - self.front + 1
        if occupied == 0 or (occupied < self.buffer and self._progress(self.last) >= self.add_at):
            self.last += 1
            self.masks[self.last] = self.size

    def _advance(self) -> None:
        """The next step's entry; a step that would sample nothing (upstream: a forward that
        only stores keys) is run here, without a forward, until one samples."""
        for _ in range(2 * self.buffer + 2):
            self._enter()
            if self.window_masks() > 0:
                return
            self._postprocess()
            if self.done:
                return
        raise RuntimeError("multi_bd: the running set stopped advancing")  # unreachable
