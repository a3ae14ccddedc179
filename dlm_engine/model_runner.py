"""One denoising step for a batch of rows: batched forward, proposals, selection, commit.

Rows are right-padded to a common length with per-row position ids and a key-padding mask,
so padding never shifts RoPE positions or enters attention. Logits are computed only for each
row's active window (its block; shifted one left for Dream), which is exact: positions outside
the window are never selected by the published loops. The only device-to-host copy is the
committed windows at the end.
"""

from __future__ import annotations

import torch
from torch import nn

from .decoding import RowDecode, propose, select_transfers
from .models.common import ForwardBatch
from .sequence import Sequence


class ModelRunner:
    """Owns the model and runs batched steps over `Sequence`s."""

    def __init__(
        self,
        model: nn.Module,
        family: str,
        mask_id: int,
        eos_id: int,
        pad_id: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.family = family
        self.mask_id = mask_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.device = device
        self.shift = int(getattr(model, "logits_shift", 0))
        self.model_vocab = int(model.vocab_size)

    def _forward_rows(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, K, V] and current tokens [B, K] over each row's window.

        CFG rows get their unconditional pass (prompt masked) as extra rows."""
        rows = [s.tokens for s in seqs]
        cfg = [i for i, s in enumerate(seqs) if s.params.cfg_scale > 0]
        for i in cfg:
            un = seqs[i].tokens.clone()
            un[: seqs[i].prompt_len] = self.mask_id
            rows.append(un)
        lengths = torch.tensor([r.numel() for r in rows], device=self.device)
        ids = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=self.pad_id)
        t = ids.shape[1]
        ar = torch.arange(t, device=self.device)
        key_mask = ar[None, :] < lengths[:, None]
        positions = ar.expand(len(rows), t)
        width = max(s.window_width for s in seqs)
        starts = [s.window_start for s in seqs] + [seqs[i].window_start for i in cfg]
        win = torch.tensor(starts, device=self.device)[:, None] + torch.arange(
            width, device=self.device
        )
        index = (win - self.shift).clamp(0, t - 1)
        with torch.inference_mode():
            logits = self.model(ForwardBatch(ids, positions, key_mask, index))
        if cfg:
            b = len(seqs)
            sel = torch.tensor(cfg, device=self.device)
            scale = torch.tensor(
                [seqs[i].params.cfg_scale for i in cfg], device=self.device, dtype=logits.dtype
            )
            cond, uncond = logits[sel], logits[b:]
            logits = logits[:b].clone()
            logits[sel] = uncond + (scale[:, None, None] + 1) * (cond - uncond)
        current = ids[: len(seqs)].gather(1, win[: len(seqs)].clamp(max=t - 1))
        return logits, current

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """Run one step for all rows; returns each row's window after this step's commits."""
        logits, current = self._forward_rows(seqs)
        dev = self.device
        widths = torch.tensor([s.window_width for s in seqs], device=dev)
        valid = torch.arange(logits.shape[1], device=dev)[None, :] < widths[:, None]
        masked = (current == self.mask_id) & valid
        rows = [
            RowDecode(
                width=s.window_width,
                algorithm=s.params.algorithm,
                temperature=s.params.temperature,
                top_p=s.params.top_p,
                top_k=s.params.top_k,
                suppress_eos=s.params.suppress_eos,
                generator=s.generator,
            )
            for s in seqs
        ]
        x0, conf = propose(self.family, logits, rows, self.eos_id)
        k = torch.tensor([0 if s.uses_threshold else s.transfer_count() for s in seqs], device=dev)
        thr = torch.tensor(
            [s.params.threshold if s.uses_threshold else float("nan") for s in seqs],
            device=dev,
            dtype=torch.float64,
        )
        chosen = select_transfers(conf, masked, k, thr)
        chosen = self._sampled_positions(seqs, chosen, conf, masked, k)
        new = torch.where(chosen, x0, current)
        for i, s in enumerate(seqs):
            w = s.window_width
            s.tokens[s.window_start : s.window_start + w] = new[i, :w]
        host = new.cpu().tolist()
        return [host[i][: s.window_width] for i, s in enumerate(seqs)]

    def _sampled_positions(
        self,
        seqs: list[Sequence],
        chosen: torch.Tensor,
        conf: torch.Tensor,
        masked: torch.Tensor,
        k: torch.Tensor,
    ) -> torch.Tensor:
        """Rows that pick positions at random: Dream's `origin` and `alg_temp` sampling."""
        for i, s in enumerate(seqs):
            if s.params.algorithm == "origin":
                m = masked[i]
                draws = torch.rand(int(m.sum()), device=self.device, generator=s.generator)
                pick = torch.zeros_like(m)
                pick[m] = draws < s.origin_probability()
                chosen[i] = pick
            elif s.params.alg_temp and not s.uses_threshold and int(k[i]) > 0:
                w = s.window_width  # draw over the row's own window: batching never changes it
                c = conf[i, :w].masked_fill(~masked[i, :w], -torch.inf) / s.params.alg_temp
                idx = torch.multinomial(
                    torch.softmax(c.float(), -1), int(k[i]), generator=s.generator
                )
                pick = torch.zeros_like(masked[i])
                pick[idx] = True
                chosen[i] = pick
        return chosen
