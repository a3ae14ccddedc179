"""One request's canvas and progress through its blocks and steps."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .decoding import DreamSchedule, llada_block_schedule
from .decoding.multi_block import MultiBlockState
from .sampling_params import ResolvedParams

if TYPE_CHECKING:
    from .decoding.constraints import RowConstraint
    from .decoding.logprobs import TokenLogprob


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
        family: str,
        mask_id: int,
        device: torch.device,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.family = family
        self.mask_id = mask_id
        self.prompt_len = len(prompt_ids)
        self.tokens = torch.tensor(prompt_ids + [mask_id] * params.max_tokens, device=device)
        self.canvas: list[int] = [mask_id] * params.max_tokens
        self.generator: torch.Generator | None = None
        if params.temperature > 0 or params.algorithm in ("random", "origin") or params.alg_temp:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)
        self.block = 0
        self.step_in_block = 0
        self.masks_in_block = params.block_length
        self.forwards = 0
        self.sent_text = ""
        self.finished = False
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.constraint: RowConstraint | None = None  # grammar matcher (decoding/constraints)
        # issue 17: canvas position -> its committed token's logprob (rows with `logprobs`)
        self.logprobs: dict[int, TokenLogprob] = {}
        self._llada_schedule = llada_block_schedule(params.block_length, params.steps_per_block)
        self._dream_schedule = DreamSchedule(params.steps_per_block)
        self.multi = (  # d3LLM multi-block decoding: several blocks in flight (issue 15)
            MultiBlockState(params.max_tokens, params.block_length, params.accel)
            if params.accel.multi_block
            else None
        )

    @property
    def length(self) -> int:
        return self.prompt_len + self.params.max_tokens

    @property
    def window_start(self) -> int:
        """Absolute position of the active block's first token."""
        if self.multi is not None:
            return self.prompt_len + self.multi.window()[0]
        return self.prompt_len + self.block * self.params.block_length

    @property
    def window_width(self) -> int:
        if self.multi is not None:
            lo, hi = self.multi.window()
            return hi - lo
        return self.params.block_length

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
        if self.family == "llada":
            return self._llada_schedule[self.step_in_block]
        return self._dream_schedule.count(self.step_in_block, self.masks_in_block)

    def origin_probability(self) -> float:
        if self.last_forward:
            return 1.0  # every masked position of the canvas is committed now
        return self._dream_schedule.origin_probability(self.step_in_block)

    def absorb(self, window_tokens: list[int]) -> None:
        """Take the step's committed window into the host mirror and advance the schedule."""
        start = self.window_start - self.prompt_len
        self.canvas[start : start + len(window_tokens)] = window_tokens
        if self.multi is not None:
            self.forwards += 1
            self.multi.absorb(self.canvas, self.mask_id)
            return
        self.masks_in_block = sum(1 for t in window_tokens if t == self.mask_id)
        self.forwards += 1
        self.step_in_block += 1
        if self.masks_in_block == 0 and self.block + 1 < self.params.num_blocks:
            self.block += 1
            self.step_in_block = 0
            self.masks_in_block = self.params.block_length

    def committed_prefix(self) -> list[int]:
        """The canvas up to its first mask: text that can no longer change."""
        try:
            return self.canvas[: self.canvas.index(self.mask_id)]
        except ValueError:
            return list(self.canvas)
