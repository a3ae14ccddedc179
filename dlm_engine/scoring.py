"""Scoring a text under the masked-diffusion objective (issue 17): a Monte-Carlo estimate of its
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

Scoring runs between denoising steps, one batch of samples per engine step, so a long scoring
request never holds generation rows up for more than one forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .reference import full_logits

DEFAULT_MC_SAMPLES = 32
# logits of a batch held at once, in elements: rows per forward are cut to stay under it
_MAX_LOGIT_ELEMENTS = 1 << 27
MAX_BATCH = 8


@dataclass
class ScoreJob:
    """One scoring request: the text's ids, samples to run, and the contributions so far."""

    request_id: str
    ids: list[int]
    samples: int
    generator: torch.Generator  # on the CPU: the same draws on every device
    shift: int  # 1 for Dream (shifted logits): position 0 is context only
    rows: list[torch.Tensor] = field(default_factory=list)  # [b, L] contributions per batch
    forwards: int = 0

    @property
    def done(self) -> int:
        return sum(r.shape[0] for r in self.rows)

    @property
    def finished(self) -> bool:
        return self.done >= self.samples


def batch_rows(job: ScoreJob, vocab: int) -> int:
    """Samples in the next forward: at most MAX_BATCH, and few enough logits to hold."""
    fit = max(1, _MAX_LOGIT_ELEMENTS // max(1, len(job.ids) * vocab))
    return max(1, min(MAX_BATCH, fit, job.samples - job.done))


@torch.inference_mode()
def run_batch(job: ScoreJob, model: torch.nn.Module, mask_id: int, device: torch.device) -> None:
    """One forward over `batch_rows` masked copies of the text; their contributions kept."""
    ids = torch.tensor(job.ids, device=device)
    length = ids.numel()
    b = batch_rows(job, int(model.vocab_size))
    targets = length - job.shift  # positions that can be masked
    g = job.generator
    # LLaDA's forward_process: stratified mask counts from one uniform start, random positions
    k = int(torch.randint(1, targets + 1, (), generator=g))
    counts = torch.round(
        torch.linspace(float(k), k + (b - 1) * (targets / b), steps=b, dtype=torch.float64)
    ).long()
    counts = (counts - 1) % targets + 1
    order = torch.stack([torch.randperm(targets, generator=g) for _ in range(b)])
    masked = torch.zeros(b, length, dtype=torch.bool)
    masked[:, job.shift :] = order < counts[:, None]
    masked = masked.to(device)
    noisy = torch.where(masked, mask_id, ids.expand(b, length))
    logits = full_logits(model)(noisy)
    if job.shift:  # Dream: the output at i - 1 predicts position i
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    sel = masked.nonzero(as_tuple=True)
    ll = -F.cross_entropy(logits[sel].float(), ids.expand(b, length)[sel], reduction="none")
    ratio = (counts.to(device=device, dtype=torch.float32) / targets)[:, None].expand(b, length)
    contrib = torch.zeros(b, length, dtype=torch.float32, device=device)
    contrib[sel] = ll / ratio[sel]
    job.rows.append(contrib.cpu())
    job.forwards += 1


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
