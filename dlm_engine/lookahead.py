"""The next step's forward, queued before the host reads this step's results.

Between two in-block steps the device would idle while the host waits for the step's
committed windows, advances each row and replays the next graph: a noticeable share of a
batch-1 step of a large model (docs/benchmarks.md). A step's commits are written on the device
(`Sequence.tokens`), and the next forward of a row that stays in its block reads the same
positions with only those tokens changed. So when every row of a step will stay in its block,
the runner queues the next step's forward right behind this step's commit, before it waits for
the copy (`ModelRunner.step`), and the next step takes it if its rows and plan are the ones it
was made for. Otherwise it is dropped: a row finished on a stop string, left or was aborted,
and the device ran one forward for nothing. Tokens never change: the forward taken is the very
one the next step would have queued, queued earlier. A request that arrives while a forward
waits ahead joins one step later (the engine defers admission; the step a row joins never
changes its tokens).

vLLM's asynchronous scheduling hides the same host time by scheduling step N+1 before step N's
results reach the host; here the commit already happens on the device, so only the forward
needs to move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decoding.commit_rules import RANK
from .ragged import PackedPlan


@dataclass
class Lookahead:
    """A forward queued for the next step: what it was made for, and its outputs."""

    made_for: tuple  # the plan's key (ModelRunner._window_logits: rows, width, pool, ...)
    request_ids: tuple[str, ...]
    plan: PackedPlan
    logits: torch.Tensor  # [rows, width, V] of each row's window
    current: torch.Tensor  # the window tokens the forward saw

    def holds(self, seqs) -> bool:
        """Made for exactly these rows, in this order."""
        return self.request_ids == tuple(s.request_id for s in seqs)


def stays_in_block(seq) -> bool:
    """Will `seq` feed the very same query (positions, window, slot) at its next step? Only
    when this step commits a count fixed by the schedule (rank rules: LLaDA's low-confidence
    remasking, Dream's entropy / margin / confidence orders) that leaves masks in the block,
    and the row is not at a cache refresh (the next query would be its first span). Rows whose
    count depends on the logits (thresholds, Dream's `origin` draws), block-diffusion,
    multi-block and editing rows are not predicted."""
    if seq.paged or seq.multi is not None or seq.mbd is not None or seq.editing:
        return False
    if seq.slot_cached and seq.refreshing:
        return False
    if seq.rule.draws_positions or seq.last_forward:
        return False
    if seq.rule.rule_code(seq.uses_threshold) != RANK:
        return False
    return seq.masks_in_block - seq.transfer_count() > 0
