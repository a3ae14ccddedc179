"""d3LLM's multi-block decoding: several blocks of one canvas in flight at once.

Host-side bookkeeping for one request, restated from hao-ai-lab/d3LLM's
`generate_multi_block` (LLaDA) / `_sample_multi_block` (Dream) and SGLang PR #20615's
`FullAttnMultiBlock` (see `reference.d3llm_multi_block_generate`). Before each step, a block
whose predecessor has decoded at least `decoded_token_threshold` of its tokens becomes
*activated*, and a new block is added once the last block's progress reaches
`block_add_threshold` (or it is complete). The step may commit any mask up to the end of the
rightmost block in flight; the first activated block that still holds masks must get at least
one commit. Mask counts come from the host copy of the canvas the engine already makes each
step, so this adds no device synchronisation.

With `cache: prefix`, `DelayedCache` adds d3LLM's delayed KV cache
(`generate_multi_block_kv_cache` / `_sample_multi_block_kv_cache`, restated in
`reference.d3llm_multi_block_cached_generate`): a decoded block's keys are cached once it has
stayed decoded `cache_delay_iter` steps. Each step is one of: a full forward (no cache yet, or a refresh), a caching step or a
span step (the suffix from the cache's end over the row's pool slot).

With `early_stop` (d3LLM's `handle_early_stop`, restated in
`reference.d3llm_multi_block_generate`), the first end-of-text token of the canvas fills every
position after it with end-of-text before each step, and the blocks past it close; the
positions this fill took from the mask stay candidates of that one step, as upstream (its mask
set is taken before the fill), and a commit there is undone by the next fill.
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
    completed_at: int | None = None  # delayed cache: the step that first saw it decoded
    cached: bool = False

    @property
    def progress(self) -> float:
        return 1 - self.masks / (self.end - self.start)


class MultiBlockState:
    """The blocks of one request that have been added so far (d3LLM's `block_states`)."""

    def __init__(
        self,
        canvas_len: int,
        block: int,
        accel: Acceleration,
        *,
        cache: DelayedCache | None = None,
        eos_id: int | None = None,
    ) -> None:
        self.cache = cache
        self.block = block
        self.eos_id = eos_id  # early stop's fill token; None: off
        self.fill_from: int | None = None  # canvas-relative start of the last fill to copy
        self.stale: tuple[int, ...] = ()  # positions the last fill took from the mask
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
        """Recount each block's masks from the canvas after a step, apply early stop (which
        may rewrite `canvas` in place), then prepare the next step."""
        for b in self.blocks:
            b.masks = sum(1 for t in canvas[b.start : b.end] if t == mask_id)
        self.fill_from, self.stale = None, ()
        if self.eos_id is not None:
            self._early_stop(canvas, mask_id)
        self.prepare()
        if self.cache is not None:
            self.cache.planned = None

    def _early_stop(self, canvas: list[int], mask_id: int) -> None:
        """d3LLM's early stop at the top of a step: end-of-text after the first one; a block
        past it holding masks closes (no mask, activated), the block holding it counts its
        masks up to it (activated when that count changed to none), and the blocks not yet
        added are added closed."""
        eos = self.eos_id
        first = next((i for i, t in enumerate(canvas) if t == eos), None)
        if first is None:
            return
        tail = canvas[first + 1 :]
        self.stale = tuple(first + 1 + i for i, t in enumerate(tail) if t == mask_id)
        if any(t != eos for t in tail):
            self.fill_from = first + 1
            canvas[first + 1 :] = [eos] * len(tail)
        for b in self.blocks:
            if b.start > first and b.masks:
                b.masks, b.active = 0, True
            elif b.start <= first < b.end:
                before = sum(1 for t in canvas[b.start : first + 1] if t == mask_id)
                if before != b.masks:
                    b.masks = before
                    b.active = b.active or before == 0
        while len(self.blocks) < self.num_blocks:
            start = self.blocks[-1].end
            self.blocks.append(Block(start, start + self.block, 0, True))

    def cache_step(self) -> tuple[str, int]:
        """Delayed cache: this step's kind and the canvas-relative start of its query (see
        `DelayedCache.plan`); decided once per step, when the step runs."""
        c = self.cache
        if c.planned is None:
            c.planned = c.plan(self.blocks)
        return c.planned

    @property
    def in_flight(self) -> int:
        return sum(1 for b in self.blocks if b.masks > 0)


class DelayedCache:
    """d3LLM's delayed KV cache of one multi-block row (`cache: prefix`).

    The pool slot holds the keys of canvas-relative positions [-prompt, `length`) that the
    next span step reads; every full forward stores all keys, a span step its query's, so
    the slot's prefix is always the one upstream's cache holds (and never duplicated: see
    `reference.d3llm_multi_block_cached_generate` for the upstream defect not copied)."""

    def __init__(
        self, prompt_len: int, delay: int, refresh_interval: int | None, *, walk_stops: bool
    ) -> None:
        self.delay = delay
        self.refresh_interval = refresh_interval
        self.walk_stops = walk_stops  # LLaDA: a block within its delay ends the walk; Dream no
        self.prompt = Block(-prompt_len, 0, 0, True, completed_at=0)  # block 0
        self.length = -prompt_len  # canvas-relative end of the cached keys
        self.exists = False  # upstream's past_key_values is not None
        self.nfe = 0
        self.planned: tuple[str, int] | None = None
        self.history: list[str] = []  # each step's kind: full, cache, span, refresh, periodic
        # refreshes where upstream keeps keys past the cache's end (two blocks stabilizing
        # together, Dream only): its next caching step would append them a second time
        self.upstream_overlaps = 0

    def plan(self, blocks: list[Block]) -> tuple[str, int]:
        """The caching decisions at the top of a step (after activation and adding): returns
        the step's kind and its query start (canvas-relative): `full` (no cache yet) /
        `refresh` (a block is stabilizing) / `periodic` (`refresh_interval`) feed the whole
        sequence (-prompt), `cache` / `span` the suffix from the cache's end (a first
        `cache` with no cache yet feeds the whole sequence too)."""
        self.nfe += 1
        every = [self.prompt, *blocks]
        cache_to = None
        for b in every:
            if b.end <= self.length:
                continue
            if b.masks > 0:
                break
            if b.completed_at is None:
                b.completed_at = self.nfe
            waited = self.nfe - b.completed_at
            if waited >= self.delay and not b.cached:
                b.cached = True
                cache_to = b.end
            elif waited < self.delay and self.walk_stops:
                break
        stabilizing = any(
            b.masks == 0 and b.completed_at is not None and not b.cached for b in every
        )
        periodic = self.refresh_interval is not None and self.nfe % self.refresh_interval == 0
        start = self.prompt.start
        if cache_to is not None:
            kind = "cache"
            start = self.length if self.exists else start
            self.length, self.exists = cache_to, True
        elif self.exists and not stabilizing and not periodic:
            kind, start = "span", self.length
        else:
            kind = "full" if not self.exists else "refresh" if stabilizing else "periodic"
            if kind == "refresh":
                latest = max(
                    b.start
                    for b in every
                    if b.masks == 0 and b.completed_at is not None and not b.cached
                )
                self.upstream_overlaps += latest > self.length
        self.history.append(kind)
        return kind, start
