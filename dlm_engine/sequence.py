"""One request's canvas and progress through its blocks and steps."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .block_diffusion import BlockLayout
from .decoding import DreamSchedule, llada_block_schedule
from .decoding.strategies import row_strategy, strategy_of
from .models import Family, family_of
from .sampling_params import ResolvedParams

if TYPE_CHECKING:
    from .decoding.constraints import RowConstraint
    from .decoding.logprobs import TokenLogprob
    from .decoding.multi_bd import MultiBDState
    from .decoding.multi_block import MultiBlockState


class Sequence:
    """A request in the engine: device tokens (prompt + canvas) and a host mirror of the canvas.

    The host mirror is refreshed from one small copy per step; everything the server streams
    (stable text, finish) is derived from it without touching the device again.
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: ResolvedParams,
        *,
        family: Family | str,
        mask_id: int,
        device: torch.device,
        stop_ids: frozenset[int] = frozenset(),
        eos_id: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.family = family_of(family)
        self.mask_id = mask_id
        self.prompt_len = len(prompt_ids)
        # block-diffusion rows decode absolute-aligned blocks over an exact KV cache
        self.layout = (
            BlockLayout(self.prompt_len, params.block_length, params.max_tokens)
            if params.block_diffusion
            else None
        )
        # block rows: first position whose cached keys are not final (at admission: the end
        # of the prompt pages shared from the prefix cache, dlm_engine/block_pages.py)
        self.kv_upto = 0
        # prompt tokens whose keys came from the prefix cache (usage's `cached_tokens`)
        self.cached_tokens = 0
        # the row's decoding strategy (decoding/strategies/): `rule` is its algorithm's
        # commit rule, `strategy` what runs the row (multi-block decoding, or the rule itself)
        self.rule = strategy_of(params.algorithm)
        self.strategy = row_strategy(params)
        self.slot_cached = self.strategy.slot_cached(params)  # keys in a KV slot of the pool
        self.phased = self.strategy.phased(params)  # refreshes at block starts with the others
        self.paged = self.strategy.paged  # keys in pages of finished blocks
        # per-row state the strategy sets up: token editing (a block stays editable until it
        # ends, so only the canvas before `final_upto` is final), d3LLM's blocks in flight,
        # Diffulex's running set
        self.editing = False
        self.multi: MultiBlockState | None = None
        self.mbd: MultiBDState | None = None
        self.post_edits = 0
        self.block_forwards = 0
        canvas_len = self.layout.canvas_len if self.layout else params.max_tokens
        self.tokens = torch.tensor(prompt_ids + [mask_id] * canvas_len, device=device)
        self.canvas: list[int] = [mask_id] * canvas_len
        self.generator: torch.Generator | None = None
        if params.temperature > 0 or self.rule.needs_generator or params.alg_temp:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)
        self.block = self.layout.first_block if self.layout else 0
        self._window = self.layout.window(self.block) if self.layout else (0, 0)  # block rows
        self.final_upto = self._window[0] - self.prompt_len
        self.step_in_block = 0
        self.forwards = 0
        self.sent_text = ""
        self.finished = False
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.constraint: RowConstraint | None = None  # grammar matcher (decoding/constraints)
        # DiffusionGemma: the canvas its decoder reads a step, set by the engine (0: not one)
        self.decoder_tokens = 0
        # canvas position -> its committed token's logprob (rows with `logprobs`)
        self.logprobs: dict[int, TokenLogprob] = {}
        self._llada_schedule = llada_block_schedule(params.block_length, params.steps_per_block)
        self._dream_schedule = DreamSchedule(params.steps_per_block)
        self.strategy.init_row(self, eos_id=eos_id, stop_ids=stop_ids)
        self.masks_in_block = self.window_width

    @property
    def length(self) -> int:
        return self.prompt_len + len(self.canvas)

    @property
    def window_start(self) -> int:
        """Absolute position of the active block's first token."""
        if self.multi is not None:
            return self.prompt_len + self.multi.window()[0]
        if self.mbd is not None:
            return self.mbd.window()[0]
        if self.layout is not None:
            return self._window[0]
        return self.prompt_len + self.block * self.params.block_length

    @property
    def window_width(self) -> int:
        if self.multi is not None:
            lo, hi = self.multi.window()
            return hi - lo
        if self.mbd is not None:
            lo, hi = self.mbd.window()
            return hi - lo
        if self.layout is not None:
            return self._window[1] - self._window[0]
        return self.params.block_length

    @property
    def block_end(self) -> int:
        """Block rows: absolute end of the active block (the end of this step's query)."""
        return self.window_start + self.window_width

    @property
    def refreshing(self) -> bool:
        """A cached row (not block diffusion) feeding its whole sequence this step, storing
        all its keys in its slot: Fast-dLLM at a block start; a delayed-cache multi-block row
        before it has a cache, at a refresh, or at its first caching step."""
        if self.multi is not None and self.multi.cache is not None:
            return self.multi.cache_step()[1] == -self.prompt_len
        return self.step_in_block == 0

    @property
    def step_tokens(self) -> int:
        """Tokens this row feeds a forward (the scheduler's budget): the whole sequence, a
        block row's query from its first non-final cached position, or a DiffusionGemma row's
        canvas (`decoder_tokens`; its prompt goes through the encoder under the runner's own
        budget, `encode_step_tokens`)."""
        if self.decoder_tokens:
            return self.decoder_tokens
        if self.layout is not None:
            return self.block_end - self.kv_upto
        return self.length

    @property
    def last_forward(self) -> bool:
        """This step is the last `max_nfe` allows: it commits the whole active block."""
        cap = self.params.max_nfe
        return cap is not None and self.forwards + 1 >= cap

    @property
    def nfe_spent(self) -> bool:
        """The request used the forwards `max_nfe` allows (it ends with what it committed)."""
        cap = self.params.max_nfe
        return cap is not None and self.forwards >= cap

    @property
    def uses_threshold(self) -> bool:
        return self.params.threshold is not None and not self.last_forward

    @property
    def rows(self) -> int:
        """Forward rows this request takes per step (two with classifier-free guidance)."""
        return 2 if self.params.cfg_scale > 0 else 1

    def transfer_count(self) -> int:
        """Tokens the family's schedule commits at this step (unused in threshold mode)."""
        if self.step_in_block >= self.params.steps_per_block or self.last_forward:
            return self.masks_in_block  # budget spent: commit what is left
        if self.family.linear_schedule:
            return self._llada_schedule[self.step_in_block]
        return self._dream_schedule.count(self.step_in_block, self.masks_in_block)

    def origin_probability(self) -> float:
        if self.last_forward:
            return 1.0  # every masked position of the canvas is committed now
        return self._dream_schedule.origin_probability(self.step_in_block)

    def absorb(self, window_tokens: list[int] | None) -> None:
        """Take the step's committed window into the host mirror and advance the schedule
        (None: a DiffusionGemma row that only encoded this step)."""
        if self.params.uniform is not None:
            self._absorb_canvas(window_tokens)
            return
        start = self.window_start - self.prompt_len
        if self.editing:
            self._absorb_edits(start, window_tokens)
            return
        self.canvas[start : start + len(window_tokens)] = window_tokens
        if self.mbd is not None:  # the running set moves; keys final up to `kv_upto`
            self.forwards += 1
            self.kv_upto = self.mbd.absorb(self.canvas, self.mask_id, self.kv_upto)
            self.masks_in_block = self.mbd.window_masks()
            return
        if self.multi is not None:
            self.forwards += 1
            self.multi.absorb(self.canvas, self.mask_id)
            fill = self.multi.fill_from
            if fill is not None:  # early stop rewrote the canvas after end-of-text
                self.tokens[self.prompt_len + fill :] = self.multi.eos_id
            return
        self.masks_in_block = sum(1 for t in window_tokens if t == self.mask_id)
        self.forwards += 1
        self.step_in_block += 1
        if self.layout is not None:  # keys up to the active block's start are final now
            self.kv_upto = self.block * self.params.block_length
        last = self.layout.num_blocks if self.layout else self.params.num_blocks
        if self.masks_in_block == 0 and self.block + 1 < last:
            self.block += 1
            if self.layout is not None:
                self._window = self.layout.window(self.block)
            self.step_in_block = 0
            self.masks_in_block = self.window_width

    def _absorb_canvas(self, canvas: list[int] | None) -> None:
        """DiffusionGemma (decoding/uniform_diffusion.py): a step commits nothing until a
        canvas ends, then the whole canvas at once (cut at `max_tokens`); None: the row only
        encoded this step (a chunk of its prompt), no denoising step counted."""
        if canvas is None:
            return
        self.forwards += 1
        if canvas:
            start = self.block * len(canvas)
            self.canvas[start : start + len(canvas)] = canvas[: max(0, len(self.canvas) - start)]
            self.block += 1

    def _absorb_edits(self, start: int, window_tokens: list[int]) -> None:
        """joint_threshold's block end (SGLang JointThreshold): a step that changes nothing
        ends the block; so does the step after which a mask-free block has spent more than
        `max_post_edit_steps` forwards on edits (or the iteration cap)."""
        end = start + len(window_tokens)
        changed = self.canvas[start:end] != window_tokens
        self.canvas[start:end] = window_tokens
        self.masks_in_block = sum(1 for t in window_tokens if t == self.mask_id)
        self.forwards += 1
        self.block_forwards += 1
        self.step_in_block += 1
        self.kv_upto = self.block * self.params.block_length
        p = self.params
        ended = not changed
        if changed and self.masks_in_block == 0:
            self.post_edits += 1
            ended = self.post_edits > p.max_post_edit_steps
        ended |= self.block_forwards >= p.block_length + p.max_post_edit_steps + 1
        if not ended:
            return
        self.final_upto = end
        if self.block + 1 < self.layout.num_blocks:
            self.block += 1
            self._window = self.layout.window(self.block)
            self.step_in_block = self.post_edits = self.block_forwards = 0
            self.masks_in_block = self.window_width
        else:
            self.final_upto = len(self.canvas)

    @property
    def canvas_done(self) -> bool:
        """Every position the request returns is committed (block rows: the first
        `max_tokens`; positions past it only complete the last block)."""
        if self.editing:
            return self.final_upto >= self.params.max_tokens
        if self.mbd is not None and self.mbd.done:
            return True
        return self.mask_id not in self.canvas[: self.params.max_tokens]

    def committed_prefix(self) -> list[int]:
        """The canvas up to its first mask: text that can no longer change."""
        canvas = self.canvas[: self.params.max_tokens]
        if self.editing:  # the active block may still be rewritten
            canvas = canvas[: self.final_upto]
        try:
            return canvas[: canvas.index(self.mask_id)]
        except ValueError:
            return list(canvas)
