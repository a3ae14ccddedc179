"""Who joins the next denoising step: admission by (priority, arrival order) under row and
token budgets, with cached rows admitted in phase with the running cached rows.

A request's `priority` (lower first, vLLM's convention; default 0) orders the waiting queue
only: strict, no aging, and a running row is never preempted. Equal priorities keep arrival
order, so with no priorities given admission is FIFO.

A cached row's step is either a refresh (a full forward that rewrites its KV cache, at a block
start) or an in-block span over its cache; each kind is its own forward. Rows that arrive at
different times would sit at different block phases, so almost every step would pay both
forwards. A waiting cached row therefore joins when the running cached rows are about to
refresh (or none run), waiting at most ``phase_wait_steps`` steps; exact rows and rows behind
it are not held up. Which step a row joins never changes its tokens.

A block-diffusion row also needs its KV pages reserved (dlm_engine/paged_kv.py): when the
pool cannot hold its worst case now, it waits at the head of the queue until running rows
end, and the requests behind it wait too, so a long request is never starved by short ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection

from .errors import EngineOverloadedError
from .sequence import Sequence


class Scheduler:
    """Waiting queue plus the running set; requests join and leave between steps."""

    def __init__(
        self,
        max_rows: int,
        max_queue: int,
        max_step_tokens: int,
        phase_wait_steps: int = 0,
        reserve: Callable[[Sequence], bool] | None = None,
    ) -> None:
        self.max_rows = max_rows
        # claims what a request needs besides rows and tokens (a block row's KV pages);
        # False: not now, the request waits
        self.reserve = reserve
        self.max_queue = max_queue
        self.max_step_tokens = max_step_tokens
        self.phase_wait_steps = phase_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._held: dict[str, int] = {}  # request id -> steps held back for phase

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise EngineOverloadedError(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(seq)

    def admit(self) -> None:
        """Move waiting requests into the batch, lowest priority value first (arrival order
        among equals), while rows and tokens allow (at least one)."""
        rows, tokens = _budget_use(self.running)
        in_phase = self._cached_rows_in_phase()
        for seq in sorted(self.waiting, key=_priority):  # stable: FIFO within a priority
            fits = (
                rows + seq.rows <= self.max_rows
                and tokens + seq.step_tokens * seq.rows <= self.max_step_tokens
            )
            if self.running and not fits:
                break
            if not in_phase and self._hold(seq):
                continue
            if self.reserve is not None and not self.reserve(seq):
                break  # its KV pages are not free yet: it waits, and so do those behind it
            self.waiting.remove(seq)
            self._held.pop(seq.request_id, None)
            self.running.append(seq)
            rows += seq.rows
            tokens += seq.step_tokens * seq.rows

    def opens_phase(self) -> bool:
        """True when nothing runs and a cached row waits: the next step starts the block phase
        that later cached rows must join (the engine loop may gather a burst first). Not while
        rows run: waiting then would slow their steps."""
        return not self.running and any(s.phased for s in self.waiting)

    def running_tokens(self) -> int:
        """Tokens the running rows feed this step's forward (scoring earns its share of the
        steps from them: dlm_engine/scoring.py)."""
        return _budget_use(self.running)[1]

    def waiting_fill_a_step(self) -> bool:
        """True when the waiting requests alone use a whole step's rows or tokens: one that
        arrives now could not join the next step, so gathering a burst longer gains nothing."""
        rows, tokens = _budget_use(self.waiting)
        return rows >= self.max_rows or tokens >= self.max_step_tokens

    def _cached_rows_in_phase(self) -> bool:
        """True when a cached row joining now would refresh together with the running ones.
        Fast-dLLM rows only: a multi-block row's cache follows its own blocks (no block start)."""
        cached = [s for s in self.running if s.phased]
        return not cached or any(s.step_in_block == 0 for s in cached)

    def _hold(self, seq: Sequence) -> bool:
        """Hold a cached row back one more step, unless it has waited long enough."""
        if not seq.phased or self.phase_wait_steps <= 0:
            return False
        held = self._held.get(seq.request_id, 0)
        if held >= self.phase_wait_steps:
            return False
        self._held[seq.request_id] = held + 1
        return True

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out wherever it is; None if unknown."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._held.pop(request_id, None)
                return seq
        return None

    def retire_finished(self) -> None:
        self.running = [s for s in self.running if not s.finished]

    def __contains__(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in (*self.running, *self.waiting))


def _budget_use(seqs: Collection[Sequence]) -> tuple[int, int]:
    """The rows and tokens these requests take of a step's `max_rows` / `max_step_tokens`
    (classifier-free guidance counts a row twice)."""
    return sum(s.rows for s in seqs), sum(s.step_tokens * s.rows for s in seqs)


def _priority(seq: Sequence) -> int:
    return seq.params.priority
