"""Scoring a text under the masked-diffusion objective: a Monte-Carlo estimate of its
log-likelihood (a lower bound, the ELBO), per token, with its variance — what LLaDA's own
`get_log_likelihood.py` computes.

One sample: a mask ratio t = k / L is drawn (LLaDA's `forward_process`: the b rows of a batch
take stratified counts k, k + L/b, ... from one uniform start, each row masking a random set of
that many positions), the masked text is run through the model once, and each masked position
i adds `log p(x_i | unmasked) / t` to its token; unmasked positions add 0. Averaged over the
samples, token i's value estimates its share of the ELBO, and the values sum to the estimate of
the text's log-likelihood bound. Variances are those of these means (the sample variance over
samples / their count; the stratified draws are treated as independent, which slightly
overstates it).

Dream predicts position i from the output at i - 1 (shifted logits): its first token is never
masked and gets no value.

Scoring shares the engine's steps with generation (`ScoringQueue`). A batch's masks are drawn
at once, as above, and its rows run in chunks of at most `step_tokens` tokens (one row at
least: a text's attention is not split), one chunk in a step. The chunk size depends only on
the text and the setting, never on what else runs, so the estimate is the same alone or beside
generation. Scoring ranks below generation, whatever the requests' priorities: while
generation rows run (a request that just arrived joins them first), it earns per step half the tokens the generation rows feed (at
most `step_tokens`) and runs a chunk only when its earnings cover the chunk's tokens. So it
feeds at most half the tokens of the generation beside it (a neighbour's steps cost about 1.5x
their own forwards at most), a request that arrives while a chunk runs waits for that one chunk
only, and scoring still advances every few steps. With no generation it runs a chunk a step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .models.common import full_logits

DEFAULT_MC_SAMPLES = 32
# logits of a batch held at once, in elements: rows per batch are cut to stay under it
_MAX_LOGIT_ELEMENTS = 1 << 27
MAX_BATCH = 8


@dataclass
class _Draw:
    """One batch's masks, drawn together (stratified over its rows), run in chunks of rows."""

    masked: torch.Tensor  # [b, L] bool, on the CPU
    counts: torch.Tensor  # [b] positions masked per row
    parts: list[torch.Tensor] = field(default_factory=list)  # contributions of rows run

    @property
    def rows_done(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    @property
    def rows_left(self) -> int:
        return self.masked.shape[0] - self.rows_done


@dataclass
class ScoreJob:
    """One scoring request: the text's ids, samples to run, and the contributions so far."""

    request_id: str
    ids: list[int]
    samples: int
    generator: torch.Generator  # on the CPU: the same draws on every device
    shift: int  # 1 for Dream (shifted logits): position 0 is context only
    priority: int = 0  # among scoring requests: lower first, then arrival order
    rows: list[torch.Tensor] = field(default_factory=list)  # [b, L] contributions per batch
    forwards: int = 0
    draw: _Draw | None = None  # the batch being run, when part of it has run

    @property
    def done(self) -> int:
        return sum(r.shape[0] for r in self.rows)

    @property
    def finished(self) -> bool:
        return self.done >= self.samples


def batch_rows(job: ScoreJob, vocab: int) -> int:
    """Samples of the next batch (drawn together): at most MAX_BATCH, and few enough logits to
    hold."""
    fit = max(1, _MAX_LOGIT_ELEMENTS // max(1, len(job.ids) * vocab))
    return max(1, min(MAX_BATCH, fit, job.samples - job.done))


def chunk_rows(job: ScoreJob, vocab: int, step_tokens: int) -> int:
    """Rows of the job's next forward: what is left of its batch, cut to `step_tokens` tokens
    (one row at least)."""
    left = job.draw.rows_left if job.draw is not None else batch_rows(job, vocab)
    return max(1, min(left, step_tokens // len(job.ids)))


def _draw(job: ScoreJob, b: int) -> _Draw:
    """LLaDA's forward_process for b rows: stratified mask counts from one uniform start,
    random positions."""
    length = len(job.ids)
    targets = length - job.shift  # positions that can be masked
    g = job.generator
    k = int(torch.randint(1, targets + 1, (), generator=g))
    counts = torch.round(
        torch.linspace(float(k), k + (b - 1) * (targets / b), steps=b, dtype=torch.float64)
    ).long()
    counts = (counts - 1) % targets + 1
    order = torch.stack([torch.randperm(targets, generator=g) for _ in range(b)])
    masked = torch.zeros(b, length, dtype=torch.bool)
    masked[:, job.shift :] = order < counts[:, None]
    return _Draw(masked, counts)


@torch.inference_mode()
def run_chunk(
    job: ScoreJob, model: torch.nn.Module, mask_id: int, device: torch.device, rows: int
) -> None:
    """One forward over the next `rows` masked copies of the text (drawing a batch first when
    none is under way); a batch's contributions are kept once all its rows have run."""
    if job.draw is None:
        job.draw = _draw(job, batch_rows(job, int(model.vocab_size)))
    d = job.draw
    start = d.rows_done
    rows = min(rows, d.rows_left)
    ids = torch.tensor(job.ids, device=device)
    length = ids.numel()
    masked = d.masked[start : start + rows].to(device)
    noisy = torch.where(masked, mask_id, ids.expand(rows, length))
    logits = full_logits(model)(noisy)
    if job.shift:  # Dream: the output at i - 1 predicts position i
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    sel = masked.nonzero(as_tuple=True)
    ll = -F.cross_entropy(logits[sel].float(), ids.expand(rows, length)[sel], reduction="none")
    counts = d.counts[start : start + rows].to(device=device, dtype=torch.float32)
    ratio = (counts / (length - job.shift))[:, None].expand(rows, length)
    contrib = torch.zeros(rows, length, dtype=torch.float32, device=device)
    contrib[sel] = ll / ratio[sel]
    d.parts.append(contrib.cpu())
    job.forwards += 1
    if d.rows_left == 0:
        job.rows.append(torch.cat(d.parts))
        job.draw = None


class ScoringQueue:
    """Scoring requests and their share of the engine's steps (the module docstring says how
    it is shared)."""

    def __init__(self, step_tokens: int, vocab: int) -> None:
        self.step_tokens = step_tokens
        self.vocab = vocab
        self.jobs: list[ScoreJob] = []  # arrival order
        self.credit = 0  # tokens earned beside generation, not yet spent

    def add(self, job: ScoreJob) -> None:
        self.jobs.append(job)

    def remove(self, request_id: str) -> ScoreJob | None:
        job = next((j for j in self.jobs if j.request_id == request_id), None)
        if job is not None:
            self.jobs.remove(job)
        if not self.jobs:
            self.credit = 0
        return job

    def __contains__(self, request_id: object) -> bool:
        return any(j.request_id == request_id for j in self.jobs)

    def __iter__(self) -> Iterator[ScoreJob]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)

    def next_chunk(self) -> tuple[ScoreJob, int]:
        """The job that runs next (lowest priority value, then oldest) and its chunk's rows."""
        job = min(self.jobs, key=lambda j: j.priority)  # stable: oldest among equals
        return job, chunk_rows(job, self.vocab, self.step_tokens)

    def take_turn(self, generation_busy: bool) -> tuple[ScoreJob, int] | None:
        """The chunk to run in this step, or None: scoring waits for its share. With no
        generation row running (rows that cannot join yet do not stall it), a chunk every step
        and nothing banked for later."""
        if not self.jobs:
            return None
        job, rows = self.next_chunk()
        if not generation_busy:
            self.credit = 0
            return job, rows
        cost = rows * len(job.ids)
        if self.credit < cost:
            return None
        self.credit -= cost
        return job, rows

    def earn(self, generation_tokens: int) -> None:
        """Credit for a step whose generation rows fed `generation_tokens` tokens: half as
        many, at most `step_tokens`, banked up to one chunk (or `step_tokens` when a chunk is
        smaller)."""
        if not self.jobs:
            self.credit = 0
            return
        job, rows = self.next_chunk()
        cap = max(self.step_tokens, rows * len(job.ids))
        share = min(self.step_tokens, (generation_tokens + 1) // 2)
        self.credit = min(cap, self.credit + share)


def summary(job: ScoreJob) -> tuple[list[float | None], list[float | None], dict[str, Any]]:
    """Per-token estimates and their variances (None: not scored), and the totals."""
    c = torch.cat(job.rows).double()  # [S, L]
    s = c.shape[0]
    mean = c.mean(0)
    var = c.var(0, unbiased=True) / s if s > 1 else torch.full_like(mean, math.nan)
    totals = c.sum(1)
    total_var = float(totals.var(unbiased=True) / s) if s > 1 else None
    values: list[float | None] = [None] * job.shift + mean[job.shift :].tolist()
    variances: list[float | None] = [None] * job.shift + [
        None if math.isnan(v) else v for v in var[job.shift :].tolist()
    ]
    score = {
        "log_likelihood": float(totals.mean()),
        "variance": total_var,
        "mc_samples": s,
        "tokens": len(job.ids) - job.shift,
    }
    return values, variances, score
