"""One denoising step for a batch of rows: batched forwards, proposals, selection, commit.

Rows are right-padded to a common length with per-row position ids and a key-padding mask, so
padding never shifts RoPE positions or enters attention. Logits are computed only for each
row's active window (its block; shifted one left for Dream), which is exact: positions outside
the window are never selected by the published loops. The only device-to-host copy is the
committed windows at the end.

Rows fall in up to three groups per step, each one forward: exact rows (full forward), cached
rows at a block start (full forward that refreshes their KV cache) and cached rows inside a
block (forward over a span against the cache). On CUDA each forward replays a captured graph.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .cuda_graphs import GraphCache, round_up
from .decoding import RowDecode, RowIndex, propose, select_transfers
from .decoding.commit_rules import CommitPlan, row_rule
from .decoding.constraints import ConstrainedStep, ConstraintRuntime
from .decoding.proposals import safe_probabilities
from .kv_cache import KVPool, RefreshKV, SpanKV
from .models.common import ForwardBatch, FusedKernels
from .row_guard import RowGuard
from .sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model (and its KV pool and graphs) and runs batched steps over `Sequence`s."""

    def __init__(
        self,
        model: nn.Module,
        family: str,
        mask_id: int,
        eos_id: int,
        pad_id: int,
        device: torch.device,
        *,
        max_rows: int = 16,
        cuda_graphs: bool = True,
        max_cuda_graphs: int = 24,
        fused_kernels: bool = True,
    ) -> None:
        self.model = model
        self.family = family
        self.mask_id = mask_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.device = device
        self.max_rows = max_rows
        self.shift = int(getattr(model, "logits_shift", 0))
        self.model_vocab = int(model.vocab_size)
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        use_graphs = cuda_graphs and device.type == "cuda" and max_cuda_graphs > 0
        self.graphs = GraphCache(device, max_cuda_graphs) if use_graphs else None
        if device.type == "cuda" and fused_kernels:
            FusedKernels.enabled = True
        self.length_multiple = 32 if self.graphs is not None else 1
        self.pool: KVPool | None = None
        self.slots: dict[str, int] = {}
        self.refreshes = 0
        self.span_steps = 0
        self.failed_rows: dict[int, str] = {}  # last step's rows that failed alone, and why
        # work done, for benchmarks: tokens through the layers, (query, key) pairs in
        # attention, and positions sent through the output head
        self.work = {"tokens": 0, "attn_pairs": 0, "logit_positions": 0}
        self.constraint_runtime: ConstraintRuntime | None = None  # set on first constrained row

    # ---- forwards ---------------------------------------------------------------------------
    def _run(self, key: tuple, fn, inputs: dict[str, torch.Tensor], row_pad: dict) -> torch.Tensor:
        if self.graphs is not None:
            try:
                return self.graphs.run(key, fn, inputs, row_pad)
            except RuntimeError as exc:  # e.g. a quantized kernel that cannot be captured
                log.warning("CUDA graph capture failed, running eagerly from now on: %s", exc)
                self.graphs = None
        with torch.inference_mode():
            return fn(inputs)

    def _windows(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        starts = torch.tensor([s.window_start for s in seqs], device=self.device)
        return starts[:, None] + torch.arange(width, device=self.device)

    def _full_forward(
        self, seqs: list[Sequence], width: int, refresh: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, width, V] and current window tokens for a full forward over each row."""
        rows = [s.tokens for s in seqs]
        cfg = [i for i, s in enumerate(seqs) if s.params.cfg_scale > 0]
        for i in cfg:
            un = seqs[i].tokens.clone()
            un[: seqs[i].prompt_len] = self.mask_id
            rows.append(un)
        lens = [r.numel() for r in rows]
        lengths = torch.tensor(lens, device=self.device)
        ids = nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=self.pad_id)
        t = round_up(ids.shape[1], self.length_multiple)
        ids = F.pad(ids, (0, t - ids.shape[1]), value=self.pad_id)
        key_mask = torch.arange(t, device=self.device)[None, :] < lengths[:, None]
        if cfg:  # made before the forward is queued, so the host never waits on it
            sel = torch.tensor(cfg, device=self.device)
            scale = torch.tensor(
                [seqs[i].params.cfg_scale for i in cfg], device=self.device, dtype=self.dtype
            )
        win = self._windows(seqs + [seqs[i] for i in cfg], width)
        index = (win - self.shift).clamp(0, t - 1)
        inputs = {"ids": ids, "key_mask": key_mask, "index": index}
        if self.graphs is not None and all(n == t for n in lens):
            del inputs["key_mask"]  # no padding: the unmasked (flash) attention kernel applies
        self._count(len(rows), t, t, width)
        row_pad = {"ids": self.pad_id, "key_mask": True, "index": 0, "slots": self._trash_row()}
        if refresh:
            inputs["slots"] = torch.tensor(
                [self.slots[s.request_id] for s in seqs], device=self.device
            )
        logits = self._run(
            ("full", refresh, self._pool_id()), self._full_fn(refresh), inputs, row_pad
        )
        if cfg:
            b = len(seqs)
            cond, uncond = logits[sel], logits[b:]
            logits = logits[:b].clone()
            logits[sel] = uncond + (scale[:, None, None] + 1) * (cond - uncond)
        current = ids[: len(seqs)].gather(1, win[: len(seqs)].clamp(max=t - 1))
        return logits, current

    def _full_fn(self, refresh: bool):
        model, pool = self.model, self.pool

        def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
            ids = x["ids"]
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            kv = RefreshKV(pool, x["slots"]) if refresh else None
            return model(ForwardBatch(ids, pos, x.get("key_mask"), x["index"], kv))

        return fn

    def _span_forward(self, seqs: list[Sequence], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and current window tokens for cached rows inside a block (span vs cache)."""
        pool = self.pool
        spans = []
        for s in seqs:
            start = s.window_start - self.shift
            end = s.window_start + s.window_width if s.params.cache == "dual" else s.length
            spans.append((start, end))
        s_len = round_up(max(e - b for b, e in spans), self.length_multiple)
        ids = torch.full((len(seqs), s_len), self.pad_id, dtype=torch.long, device=self.device)
        for i, (s, (b, e)) in enumerate(zip(seqs, spans, strict=False)):
            ids[i, : e - b] = s.tokens[b:e]
        starts = torch.tensor([b for b, _ in spans], device=self.device)
        span_len = torch.tensor([e - b for b, e in spans], device=self.device)
        ar = torch.arange(s_len, device=self.device)
        positions = starts[:, None] + ar
        write_pos = torch.where(ar[None, :] < span_len[:, None], positions, pool.trash_pos)
        lengths = torch.tensor([s.length for s in seqs], device=self.device)
        cache_mask = torch.arange(pool.length + 1, device=self.device)[None, :] < lengths[:, None]
        index = (
            torch.arange(width, device=self.device).clamp(max=s_len - 1).expand(len(seqs), width)
        )
        inputs = {
            "ids": ids,
            "positions": positions,
            "write_pos": write_pos,
            "cache_mask": cache_mask,
            "index": index.contiguous(),
            "slots": torch.tensor([self.slots[s.request_id] for s in seqs], device=self.device),
        }
        row_pad = {
            "ids": self.pad_id,
            "positions": 0,
            "write_pos": pool.trash_pos,
            "cache_mask": True,
            "index": 0,
            "slots": pool.trash_row,
        }
        model = self.model
        self._count(len(seqs), s_len, pool.length + 1, width)

        def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
            kv = SpanKV(pool, x["slots"], x["write_pos"], x["cache_mask"])
            return model(ForwardBatch(x["ids"], x["positions"], None, x["index"], kv))

        logits = self._run(("span", self._pool_id()), fn, inputs, row_pad)
        current = (
            torch.stack([s.tokens[s.window_start : s.window_start + width] for s in seqs])
            if all(s.window_width == width for s in seqs)
            else self._current_padded(seqs, width)
        )
        return logits, current

    def _current_padded(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        cur = torch.full((len(seqs), width), self.pad_id, dtype=torch.long, device=self.device)
        for i, s in enumerate(seqs):
            cur[i, : s.window_width] = s.tokens[s.window_start : s.window_start + s.window_width]
        return cur

    def _count(self, rows: int, queries: int, keys: int, width: int) -> None:
        self.work["tokens"] += rows * queries
        self.work["attn_pairs"] += rows * queries * keys
        self.work["logit_positions"] += rows * width

    # ---- KV pool ----------------------------------------------------------------------------
    def _pool_id(self) -> int:
        return id(self.pool) if self.pool is not None else 0

    def _trash_row(self) -> int:
        return self.pool.trash_row if self.pool is not None else 0

    def _ensure_slots(self, seqs: list[Sequence]) -> None:
        need = max(s.length for s in seqs)
        if self.pool is None or need > self.pool.length:
            length = round_up(need, 64)
            if self.pool is None:
                m = self.model
                a = m.arch
                n_layers = getattr(a, "n_layers", None) or a.num_hidden_layers
                heads = getattr(a, "n_heads", None) or a.num_attention_heads
                kv = getattr(a, "n_kv_heads", None) or a.num_key_value_heads
                hidden = getattr(a, "d_model", None) or a.hidden_size
                dtype = next(p.dtype for p in m.parameters() if p.is_floating_point())
                if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    dtype = torch.bfloat16
                self.pool = KVPool(
                    n_layers, self.max_rows, kv, hidden // heads, length, dtype, self.device
                )
            else:
                self.pool = self.pool.grown(length)
            if self.graphs is not None:
                self.graphs.clear()
        for s in seqs:
            if s.request_id not in self.slots:
                self.slots[s.request_id] = self.pool.allocate()

    def release(self, request_id: str) -> None:
        """Give a finished or aborted request's cache row back."""
        slot = self.slots.pop(request_id, None)
        if slot is not None and self.pool is not None:
            self.pool.release(slot)

    # ---- the step ---------------------------------------------------------------------------
    def _window_logits(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(s.window_width for s in seqs)
        if any(s.multi is not None for s in seqs):  # multi-block widths vary: bucket them
            width = round_up(width, self.length_multiple)
        cached = [s for s in seqs if s.params.cache != "none"]
        if cached:
            self._ensure_slots(cached)
        groups: list[tuple[list[int], str]] = []
        exact = [i for i, s in enumerate(seqs) if s.params.cache == "none"]
        refresh = [
            i for i, s in enumerate(seqs) if s.params.cache != "none" and s.step_in_block == 0
        ]
        span = [i for i, s in enumerate(seqs) if s.params.cache != "none" and s.step_in_block > 0]
        groups = [
            (g, kind) for g, kind in ((exact, "exact"), (refresh, "refresh"), (span, "span")) if g
        ]
        if len(groups) == 1:
            return self._group(groups[0][1], seqs, width)
        # index tensors first: made after a forward is queued they would wait for it
        sels = [torch.tensor(idx, device=self.device) for idx, _ in groups]
        logits = current = None
        for (idx, kind), sel in zip(groups, sels, strict=True):
            lg, cur = self._group(kind, [seqs[i] for i in idx], width)
            if logits is None:
                logits = lg.new_empty((len(seqs), *lg.shape[1:]))
                current = cur.new_empty((len(seqs), width))
            logits[sel] = lg
            current[sel] = cur
        return logits, current

    def _group(
        self, kind: str, seqs: list[Sequence], width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "span":
            self.span_steps += 1
            return self._span_forward(seqs, width)
        if kind == "refresh":
            self.refreshes += 1
        return self._full_forward(seqs, width, refresh=kind == "refresh")

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """Run one step for all rows; returns each row's window after this step's commits."""
        dev = self.device
        # every small host-to-device tensor before the forward is queued (no waits after)
        widths = torch.tensor([s.window_width for s in seqs], device=dev)
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
        index = RowIndex.build(rows, dev)
        plan = CommitPlan([row_rule(s, self.family) for s in seqs], dev)
        k = plan.k
        constrained = (
            ConstrainedStep(self.constraint_runtime, seqs) if self.constraint_runtime else None
        )
        guard = RowGuard(len(seqs), dev)
        logits, current = self._window_logits(seqs)
        if constrained:  # grammar rows: masks on the CPU while the forward runs, then in order
            constrained.prepare()
            forced = constrained.commit(logits, current)
        valid = torch.arange(logits.shape[1], device=dev)[None, :] < widths[:, None]
        masked = (current == self.mask_id) & valid
        extra = {} if plan.simple else plan.scores(logits)  # before propose edits logits
        x0, conf = propose(self.family, logits, rows, index, self.eos_id, self.mask_id, guard)
        if plan.simple:
            chosen = select_transfers(conf, masked, k, plan.threshold)
        else:
            chosen = plan.select(conf, x0, masked, extra)
        chosen = self._sampled_positions(seqs, chosen, conf, masked, k, guard)
        ok = guard.check_step(conf, x0, masked, chosen, self.mask_id)
        for i in guard.errors:  # rows whose code raised keep their tokens too (scalar fills)
            ok[i] = False
        new = torch.where(chosen, x0, current)
        if constrained:
            new = constrained.write(new, current, forced)
        new = torch.where(ok[:, None], new, current)  # a failed row commits nothing
        for i, s in enumerate(seqs):
            w = s.window_width
            s.tokens[s.window_start : s.window_start + w] = new[i, :w]
        host = torch.cat([new, ok[:, None].to(new.dtype)], dim=1).cpu().tolist()  # the one copy
        self.failed_rows = guard.messages([bool(row[-1]) for row in host])
        return [host[i][: s.window_width] for i, s in enumerate(seqs)]

    def _sampled_positions(
        self,
        seqs: list[Sequence],
        chosen: torch.Tensor,
        conf: torch.Tensor,
        masked: torch.Tensor,
        k: torch.Tensor,
        guard: RowGuard,
    ) -> torch.Tensor:
        """Rows that pick positions at random: Dream's `origin` and `alg_temp` sampling."""
        for i, s in enumerate(seqs):
            if s.params.algorithm == "origin":

                def origin(i: int = i, s: Sequence = s) -> None:
                    m = masked[i]
                    draws = torch.rand(int(m.sum()), device=self.device, generator=s.generator)
                    pick = torch.zeros_like(m)
                    pick[m] = draws < s.origin_probability()
                    chosen[i] = pick

                guard.run(i, origin)
            elif s.params.alg_temp and not s.uses_threshold and int(k[i]) > 0:

                def by_alg_temp(i: int = i, s: Sequence = s) -> None:
                    w = s.window_width  # the row's own window: batching never changes the draw
                    c = conf[i, :w].masked_fill(~masked[i, :w], -torch.inf) / s.params.alg_temp
                    p = torch.softmax(c.float(), -1)
                    guard.require_finite(i, p)
                    idx = torch.multinomial(safe_probabilities(p), int(k[i]), generator=s.generator)
                    pick = torch.zeros_like(masked[i])
                    pick[idx] = True
                    chosen[i] = pick

                guard.run(i, by_alg_temp)
        return chosen
