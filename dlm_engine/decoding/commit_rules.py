"""Which masked positions each row commits this step, for every rule at once.

Rules (per row, mixed freely in one step):
- rank: the k most confident (LLaDA's and Dream's step schedules);
- threshold: every confidence >= tau and at least the most confident (Fast-dLLM);
- factor: Fast-dLLM's `get_transfer_index_dynamic`: the n most confident while
  c_i >= 1 - f / (i + 2) (i counted from 0, i = 0 always passes); a stop at the last mask,
  or none, commits every mask;
- entropy: d3LLM's entropy threshold: entropy <= tau (LLaDA) or < tau (Dream), plus the
  lowest entropy except in Dream's multi-block loop;
- local_leap: dlmserve's LocalLeap: the k most confident are anchors; anchors with
  confidence >= kappa also commit masked positions within W whose confidence >= tau.
Multi-block rows (d3LLM) then force one commit in their first activated block if the rule
gave it none (its best-scored mask).
- multi_bd: Diffulex's multi-block diffusion (block-diffusion rows): per block of the row's
  window (its running set), every confidence > tau; a block whose predecessor is
  semi-complete (or the sequence's first block) also commits its most confident mask if none
  passed.

Everything here is vectorised over rows: no host synchronisation. Scores that upstream
computes in a different precision (entropy, LocalLeap's confidence) are computed in that
precision, and comparisons with thresholds happen in it, so the rules match bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..staging import to_device
from .sub_blocks import commit_span

# the vectorised rules; each decoding strategy names its own (decoding/strategies/)
RANK, THRESHOLD, FACTOR, ENTROPY, LEAP, SEQUENTIAL, DYNAMIC, BOUNDED, JOINT, MULTI_BD = range(10)
_SCHEDULED = (RANK, LEAP, SEQUENTIAL, DYNAMIC)  # rules that take the step schedule's k


@dataclass
class RowRule:
    """One row's commit rule for this step (host values)."""

    code: int
    k: int
    threshold: float  # tau of threshold / entropy rules (NaN when unused)
    factor: float
    anchor: float
    neighbor: float
    radius: int
    entropy_f64: bool  # entropy in float64 (eps 1e-12) rather than the logits' dtype (1e-8)
    strict: bool  # entropy < tau rather than <=
    keep_best: bool  # the lowest entropy is always committed
    forced: tuple[int, int] | None  # multi-block: window-relative first activated block
    edit: float = float("nan")  # joint_threshold: edit_threshold (NaN: no editing)
    # multi_bd: (block length, window offset in its first block, forced flag per block)
    blocks: tuple[int, int, tuple[bool, ...]] | None = None
    # window-relative [lo, hi) the row may commit in (sub-block families; None: anywhere)
    span: tuple[int, int] | None = None


def _idx(rows: list[RowRule], pred, device: torch.device) -> torch.Tensor | None:
    sel = [i for i, r in enumerate(rows) if pred(r)]
    return to_device(sel, device) if sel else None


class CommitPlan:
    """Device tensors of every row's rule, staged through pinned memory (dlm_engine/staging.py)
    so they can be built while the step's forward runs without the host waiting for it."""

    def __init__(self, rows: list[RowRule], device: torch.device) -> None:
        f64 = torch.float64
        self.rows = rows
        self.code = to_device([r.code for r in rows], device)
        self.k = to_device([r.k for r in rows], device)
        self.threshold = to_device([r.threshold for r in rows], device, f64)
        self.factor = to_device([r.factor for r in rows], device, f64)
        self.anchor = to_device([r.anchor for r in rows], device, f64)
        self.neighbor = to_device([r.neighbor for r in rows], device, f64)
        self.radius = to_device([r.radius for r in rows], device)
        self.strict = to_device([r.strict for r in rows], device)
        self.keep_best = to_device([r.keep_best for r in rows], device)
        self.ent64 = _idx(rows, lambda r: r.code == ENTROPY and r.entropy_f64, device)
        self.bounded = _idx(rows, lambda r: r.code == BOUNDED, device)
        self.ent_low = _idx(rows, lambda r: r.code == ENTROPY and not r.entropy_f64, device)
        self.leap = _idx(rows, lambda r: r.code == LEAP, device)
        self.ent_rows = any(r.code == ENTROPY for r in rows)
        self.any_factor = any(r.code == FACTOR for r in rows)
        self.any_block = any(r.code in (SEQUENTIAL, DYNAMIC, BOUNDED, JOINT) for r in rows)
        self.joint = _idx(rows, lambda r: r.code == JOINT, device)
        if self.joint is not None:
            self.edit = to_device([r.edit for r in rows], device, f64)
        self.mbd = _idx(rows, lambda r: r.code == MULTI_BD, device)
        if self.mbd is not None:  # per row: block length, offset, forced flag per block
            specs = [r.blocks for r in rows if r.code == MULTI_BD]
            n = max(len(f) for _, _, f in specs)
            self.mbd_len = to_device([b for b, _, _ in specs], device)
            self.mbd_off = to_device([o for _, o, _ in specs], device)
            forced = [list(f) + [False] * (n - len(f)) for _, _, f in specs]
            self.mbd_forced = to_device(forced, device, torch.bool)
        self.span = None
        if any(r.span is not None for r in rows):
            spans = [r.span or (0, 1 << 30) for r in rows]
            self.span = (to_device([a for a, _ in spans], device),
                         to_device([b for _, b in spans], device))  # fmt: skip
        self.forced = _idx(rows, lambda r: r.forced is not None, device)
        if self.forced is not None:
            spans = [r.forced for r in rows if r.forced is not None]
            self.forced_lo = to_device([s[0] for s in spans], device)
            self.forced_hi = to_device([s[1] for s in spans], device)

    @property
    def simple(self) -> bool:
        """Only rank / threshold rows: the original selection applies unchanged."""
        return all(
            r.code in (RANK, THRESHOLD) and r.forced is None and r.span is None for r in self.rows
        )

    # ---- scores that need the unmodified logits (before `propose` edits them in place) ----
    def scores(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        b, w = logits.shape[:2]
        if self.ent64 is not None or self.ent_low is not None:
            ent = torch.full((b, w), torch.inf, dtype=torch.float64, device=logits.device)
            passes = torch.zeros((b, w), dtype=torch.bool, device=logits.device)
            for sel, f64 in ((self.ent64, True), (self.ent_low, False)):
                if sel is None:
                    continue
                lg = logits[sel]
                p = F.softmax(lg.to(torch.float64) if f64 else lg, dim=-1)
                e = -torch.sum(p * torch.log(p + (1e-12 if f64 else 1e-8)), dim=-1)
                tau = self.threshold[sel, None].to(e.dtype)
                passes[sel] = torch.where(self.strict[sel, None], e < tau, e <= tau)
                ent[sel] = e.to(torch.float64)
            out["entropy"], out["entropy_pass"] = ent, passes
        if self.leap is not None:
            out["leap_probs"] = F.softmax(logits[self.leap], dim=-1)  # the logits' dtype
        if self.bounded is not None:  # SDAR entropy_bounded: float32, p clamped to 1e-12
            ent = torch.full((b, w), torch.inf, dtype=torch.float32, device=logits.device)
            p = F.softmax(logits[self.bounded].float(), dim=-1).clamp_min(1e-12)
            ent[self.bounded] = -(p * p.log()).sum(dim=-1)
            out["bounded_entropy"] = ent
        return out

    # ---- the selection ---------------------------------------------------------------------
    def select(
        self,
        conf: torch.Tensor,
        x0: torch.Tensor,
        selectable: torch.Tensor,
        extra: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Bool [B, W]: the positions each row commits."""
        b, w = conf.shape
        dev = conf.device
        if self.span is not None:  # sub-block rows: only their current sub-block
            pos = torch.arange(w, device=dev)[None, :]
            selectable = selectable & (pos >= self.span[0][:, None]) & (pos < self.span[1][:, None])
        score = conf.to(torch.float64)
        if "entropy" in extra and self.ent_rows:
            is_ent = (self.code == ENTROPY)[:, None]
            score = torch.where(is_ent, -extra["entropy"], score)
        leap_conf = None
        if self.leap is not None:
            probs = extra["leap_probs"]
            leap_conf = probs.gather(-1, x0[self.leap, :, None]).squeeze(-1)
            score[self.leap] = leap_conf.to(torch.float64)
        score = score.masked_fill(~selectable, -torch.inf)
        order = score.argsort(dim=1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(1, order, torch.arange(w, device=dev).expand(b, w))
        best = ranks == 0
        code = self.code[:, None]
        chosen = torch.where(code == RANK, ranks < self.k[:, None], best)
        thr = self.threshold[:, None].to(conf.dtype)
        chosen = torch.where(code == THRESHOLD, (conf >= thr) | best, chosen)
        if self.any_factor:
            chosen = torch.where(code == FACTOR, self._factor(score, ranks, selectable), chosen)
        if "entropy_pass" in extra:
            keep = best & self.keep_best[:, None]
            chosen = torch.where(code == ENTROPY, extra["entropy_pass"] | keep, chosen)
        if leap_conf is not None:
            chosen[self.leap] = self._leap(leap_conf, ranks[self.leap], selectable[self.leap])
        if self.any_block:
            chosen = self._block_rules(chosen, conf, ranks, selectable, extra)
        if self.mbd is not None:
            chosen[self.mbd] = self._multi_bd(conf, ranks, selectable)
        chosen &= selectable
        if self.joint is not None:  # LLaDA2.1: rewrite decoded positions whose proposal differs
            edits = extra["decoded"] & (x0 != extra["current"])
            edits &= conf > self.edit[:, None].to(conf.dtype)
            chosen |= edits & (self.code == JOINT)[:, None]
        if self.forced is not None:
            chosen = self._force(chosen, score, selectable)
        return chosen

    def _block_rules(
        self,
        chosen: torch.Tensor,
        conf: torch.Tensor,
        ranks: torch.Tensor,
        selectable: torch.Tensor,
        extra: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """SDAR's strategies. sequential: the k masked positions nearest the
        block's start; low_confidence_dynamic: every confidence > tau when at least k pass,
        else the k most confident; entropy_bounded: the lowest entropies while their running
        sum stays below the bound, at least one."""
        code = self.code[:, None]
        k = self.k[:, None]
        order = torch.cumsum(selectable.long(), dim=1)  # 1-based rank by position
        chosen = torch.where(code == SEQUENTIAL, selectable & (order <= k), chosen)
        high = (conf > self.threshold[:, None].to(conf.dtype)) & selectable
        enough = high.sum(dim=1, keepdim=True) >= k
        chosen = torch.where(code == DYNAMIC, torch.where(enough, high, ranks < k), chosen)
        # joint_threshold (mask to token): every mask above tau, else the most confident one
        passed = high.any(dim=1, keepdim=True)
        chosen = torch.where(code == JOINT, torch.where(passed, high, ranks == 0), chosen)
        if "bounded_entropy" in extra:
            ent = extra["bounded_entropy"].masked_fill(~selectable, torch.inf)
            sorted_ent, by_ent = ent.sort(dim=1, stable=True)
            below = torch.cumsum(sorted_ent, dim=1) < self.threshold[:, None].to(ent.dtype)
            n = below.sum(dim=1).clamp(min=1)
            n = torch.minimum(n, selectable.sum(dim=1))
            w = ent.shape[1]
            ent_rank = torch.empty_like(by_ent).scatter_(
                1, by_ent, torch.arange(w, device=ent.device).expand_as(by_ent)
            )
            chosen = torch.where(code == BOUNDED, ent_rank < n[:, None], chosen)
        return chosen

    def _multi_bd(
        self, conf: torch.Tensor, ranks: torch.Tensor, selectable: torch.Tensor
    ) -> torch.Tensor:
        """Diffulex multi_bd (its SDAR / LLaDA2 samplers' accepted ids), block by block of
        each row's window: every mask with confidence > tau; a forced block that has none
        commits its most confident mask (the first on ties: the row's stable ranks)."""
        sel = self.mbd
        conf, ranks, selectable = conf[sel], ranks[sel], selectable[sel]
        n, w = conf.shape
        pos = torch.arange(w, device=conf.device)[None, :] + self.mbd_off[:, None]
        seg = (pos // self.mbd_len[:, None]).clamp(max=self.mbd_forced.shape[1] - 1)
        high = (conf > self.threshold[sel, None].to(conf.dtype)) & selectable
        passed = torch.zeros_like(self.mbd_forced, dtype=torch.long)
        passed = passed.scatter_add(1, seg, high.long()) > 0
        key = ranks.masked_fill(~selectable, w)
        best = torch.full_like(passed, w, dtype=key.dtype).scatter_reduce(1, seg, key, "amin")
        is_best = (key == best.gather(1, seg)) & selectable
        need = (self.mbd_forced & ~passed).gather(1, seg)
        return high | (is_best & need)

    def _factor(
        self, score: torch.Tensor, ranks: torch.Tensor, selectable: torch.Tensor
    ) -> torch.Tensor:
        b, w = score.shape
        i = torch.arange(w, device=score.device, dtype=torch.float64)
        sorted_score = score.sort(dim=1, descending=True).values
        bound = 1 - self.factor[:, None] / (i[None, :] + 2)
        passes = (sorted_score >= bound) | (i[None, :] == 0)
        n = passes.long().cumprod(dim=1).sum(dim=1)
        m = selectable.sum(dim=1)
        n = torch.where(n >= m - 1, m, n)
        return ranks < n[:, None]

    def _leap(
        self, leap_conf: torch.Tensor, ranks: torch.Tensor, selectable: torch.Tensor
    ) -> torch.Tensor:
        sel = self.leap
        conf = leap_conf.masked_fill(~selectable, -torch.inf)
        anchors = (ranks < self.k[sel, None]) & selectable
        strong = anchors & (conf >= self.anchor[sel, None].to(conf.dtype))
        w = conf.shape[1]
        pos = torch.arange(w, device=conf.device)
        dist = (pos[:, None] - pos[None, :]).abs()  # [W, W]
        near = ((dist[None] <= self.radius[sel, None, None]) & strong[:, None, :]).any(dim=-1)
        neighbours = near & (conf >= self.neighbor[sel, None].to(conf.dtype))
        return anchors | neighbours

    def _force(
        self, chosen: torch.Tensor, score: torch.Tensor, selectable: torch.Tensor
    ) -> torch.Tensor:
        sel = self.forced
        w = chosen.shape[1]
        pos = torch.arange(w, device=chosen.device)[None, :]
        in_block = (pos >= self.forced_lo[:, None]) & (pos < self.forced_hi[:, None])
        in_block &= selectable[sel]
        need = ~(chosen[sel] & in_block).any(dim=1) & in_block.any(dim=1)
        best = score[sel].masked_fill(~in_block, -torch.inf).argmax(dim=1)
        # a comparison, not `add[rows, best] = True`: a Python scalar put by index copies
        # the scalar to the GPU and waits for the queued forward (a stall in every step)
        add = pos == best[:, None]
        chosen[sel] |= add & need[:, None]
        return chosen


def row_rule(seq) -> RowRule:
    """The commit rule of one `Sequence` for its next step: its strategy's rule, with the
    family's variant of d3LLM's entropy comparisons."""
    p = seq.params
    a = p.accel
    code = seq.rule.rule_code(seq.uses_threshold)
    if seq.paged and seq.last_forward:
        code = RANK  # max_nfe spent: the rest of the block (multi_bd: running set) at once
    blocks = None
    if code == MULTI_BD:
        size = seq.layout.block
        blocks = (size, seq.window_start % size, seq.mbd.forced())
    forced = None
    multi = seq.multi is not None
    if multi:
        span = seq.multi.forced()
        if span is not None:
            lo = seq.window_start - seq.prompt_len
            forced = (span[0] - lo, span[1] - lo)
    span = None
    k = seq.transfer_count() if code in _SCHEDULED else 0
    if code == DYNAMIC and seq.family.sub_block_length and seq.layout is not None:
        # Fast-dLLM v2: every mask of the sub-block above tau, else its most confident one
        size = seq.layout.block
        span = commit_span(
            seq.canvas,
            prompt_len=seq.prompt_len,
            block_start=seq.block * size,
            window_start=seq.window_start,
            block=size,
            sub=seq.family.sub_block_length,
            mask_id=seq.mask_id,
        )
        k = 1
    loop = seq.family.d3llm_loop
    return RowRule(
        code=code,
        k=k,
        threshold=p.threshold if p.threshold is not None else float("nan"),
        factor=a.factor,
        anchor=a.anchor_threshold,
        neighbor=a.neighbor_threshold,
        radius=a.leap_radius,
        entropy_f64=loop.single_block_f64 or multi,
        strict=loop.strict,
        keep_best=loop.multi_block_keeps_best or not multi,
        forced=forced,
        edit=p.edit_threshold if code == JOINT else float("nan"),
        blocks=blocks,
        span=span,
    )
