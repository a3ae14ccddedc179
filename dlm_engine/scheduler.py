"""Who joins the next denoising step: FIFO admission under row and token budgets."""

from __future__ import annotations

from collections import deque

from .errors import EngineOverloadedError
from .sequence import Sequence


class Scheduler:
    """Waiting queue plus the running set; requests join and leave between steps."""

    def __init__(self, max_rows: int, max_queue: int, max_step_tokens: int) -> None:
        self.max_rows = max_rows
        self.max_queue = max_queue
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise EngineOverloadedError(f"{len(self.waiting)} requests already waiting")
        self.waiting.append(seq)

    def admit(self) -> None:
        """Move waiting requests into the batch while rows and tokens allow (at least one)."""
        rows = sum(s.rows for s in self.running)
        tokens = sum(s.length * s.rows for s in self.running)
        while self.waiting:
            seq = self.waiting[0]
            fits = (
                rows + seq.rows <= self.max_rows
                and tokens + seq.length * seq.rows <= self.max_step_tokens
            )
            if self.running and not fits:
                break
            self.waiting.popleft()
            self.running.append(seq)
            rows += seq.rows
            tokens += seq.length * seq.rows

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out wherever it is; None if unknown."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        return None

    def retire_finished(self) -> None:
        self.running = [s for s in self.running if not s.finished]

    def __contains__(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in (*self.running, *self.waiting))
