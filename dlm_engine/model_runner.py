"""One denoising step for a batch of rows: one packed forward, proposals, selection, commit.

Whatever phase each row is in (exact, cached at a block start, cached inside a block), the
step runs one forward: the query tokens of all rows are packed into one sequence, so every
weight is read once per step, and attention works per row with its own positions and keys
(dlm_engine/ragged.py). Logits are computed only for each row's active window (its block;
shifted one left for Dream), which is exact: positions outside the window are never selected
by the published loops. The only device-to-host copy is the committed windows at the end.
On CUDA the forward replays a graph captured per bucketed shape, and when every row stays in
its block the next step's forward is queued before that copy (dlm_engine/lookahead.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from . import paged_flex
from .block_pages import BlockPages
from .cuda_graphs import GraphCache, round_up, worth_a_graph
from .decoding import RowDecode, RowIndex, propose, select_transfers
from .decoding.commit_rules import CommitPlan, row_rule
from .decoding.constraints import ConstrainedStep, ConstraintRuntime
from .decoding.logit_bias import LogitBiasStep
from .decoding.proposals import safe_probabilities
from .kv_cache import KVPool
from .lookahead import Lookahead, stays_in_block
from .models import Family, family_of
from .models.common import FusedKernels
from .paged_kv import PagePool, page_size, pool_pages
from .prefix_cache import PrefixCache
from .ragged import (
    Layout,
    PackedPlan,
    RowQuery,
    packed_forward_fn,
    plan_key,
    plan_packed,
    with_new_tokens,
)
from .row_guard import RowGuard
from .sequence import Sequence
from .staging import to_device

log = logging.getLogger(__name__)


def _fast_dllm_rows(seqs: list[Sequence]) -> list[Sequence]:
    """Rows whose strategy keeps their keys in a KV slot of the pool (Fast-dLLM's prefix or
    dual cache, d3LLM's delayed cache)."""
    return [s for s in seqs if s.slot_cached]


class ModelRunner:
    """Owns the model (and its KV pool and graphs) and runs batched steps over `Sequence`s."""

    def __init__(
        self,
        model: nn.Module,
        family: Family | str,
        mask_id: int,
        eos_id: int,
        pad_id: int,
        device: torch.device,
        *,
        max_rows: int = 16,
        cuda_graphs: bool = True,
        max_cuda_graphs: int = 96,
        cuda_graph_max_tokens: int = 0,
        fused_kernels: bool = True,
        lookahead: bool = True,
        paged_attention: str = "gather",
    ) -> None:
        self.model = model
        self.family = family_of(family)
        self.mask_id = mask_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.device = device
        self.max_rows = max_rows
        self.shift = int(getattr(model, "logits_shift", 0))
        self.model_vocab = int(model.vocab_size)
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        use_graphs = cuda_graphs and device.type == "cuda" and max_cuda_graphs > 0
        # a tensor-parallel model brings its own cache: graphs on every rank, replayed together
        make = getattr(model, "graph_cache", None) or GraphCache
        self.graphs = make(device, max_cuda_graphs) if use_graphs else None
        self.graph_max_tokens = cuda_graph_max_tokens  # larger steps run eagerly (0: none do)
        self._captures_before_off = 0  # captures of a cache turned off by a failed capture
        # the last step's plan and what it was made for: an in-block step whose rows did not
        # move reuses its index tensors (ragged.plan_key; building them is host time a batch-1
        # step notices), and the graph's static inputs then need only the new tokens
        self._last_plan: tuple[tuple, PackedPlan] | None = None
        self.plan_reuses = 0
        # the next step's forward, queued before this step's copy (dlm_engine/lookahead.py);
        # on CUDA only, where the device runs it while the host reads the copy (tests turn it
        # on for the CPU to prove it changes no token)
        self.lookahead = lookahead and device.type == "cuda"
        self._ahead: Lookahead | None = None
        self._last_graphed = False
        self.lookahead_taken = 0
        self.lookahead_dropped = 0
        if device.type == "cuda" and fused_kernels:
            FusedKernels.enabled = True
        self.length_multiple = 32 if self.graphs is not None else 1
        self.pool: KVPool | None = None
        self.slots: dict[str, int] = {}
        self.refreshes = 0  # steps with a cached row feeding its whole sequence (`refreshing`)
        self.span_steps = 0  # steps with a cached row feeding a span over its slot
        self.forward_passes = 0  # forwards through the model: one per step
        self.failed_rows: dict[int, str] = {}  # last step's rows that failed alone, and why
        # work done, for benchmarks: tokens through the layers, (query, key) pairs in
        # attention, and positions sent through the output head
        self.work = {"tokens": 0, "attn_pairs": 0, "logit_positions": 0}
        self.constraint_runtime: ConstraintRuntime | None = None  # set on first constrained row
        # block-diffusion rows' page tables over a page pool (`use_pages`), and how their
        # attention reads the pages (dlm_engine/paged_flex.py)
        self.block_pages: BlockPages | None = None
        if paged_attention not in paged_flex.MODES:
            raise ValueError(f"paged_attention must be one of {paged_flex.MODES}")
        self.paged_attention = paged_attention

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far: each is an eager forward and a capture paid inside a
        step. Captures that go on under steady traffic mean step shapes keep changing (new row
        counts, a KV pool that grew and dropped every graph)."""
        if self.graphs is None:
            return self._captures_before_off
        return self.graphs.captures

    # ---- the forward ------------------------------------------------------------------------
    def _run(self, key: tuple, fn, inputs: dict[str, torch.Tensor], layout: Layout) -> torch.Tensor:
        whole = any(group == "fresh" for group, *_ in layout)  # exact rows, block-start refreshes
        graphed = worth_a_graph(inputs["ids"].shape[1], whole, self.graph_max_tokens)
        self._last_graphed = self.graphs is not None and graphed
        if self._last_graphed:
            try:
                return self.graphs.run(key, fn, inputs)
            except RuntimeError as exc:  # e.g. a quantized kernel that cannot be captured
                log.warning("CUDA graph capture failed, running eagerly from now on: %s", exc)
                self._captures_before_off = self.graphs.captures
                self.graphs = None
                self._last_graphed = False
        with torch.inference_mode():
            return fn(inputs)

    def _queries(self, seqs: list[Sequence]) -> list[RowQuery]:
        """Each forward row's query: the whole sequence (exact rows, cached rows at a block
        start), or the span a cached row recomputes inside a block (a delayed-cache
        multi-block row: the suffix from its cache's end); then the unconditional
        rows of classifier-free guidance (prompt masked). Cached rows store their keys."""
        rows: list[RowQuery] = []
        for s in seqs:
            if s.paged:  # block diffusion: from the first non-final key on
                end = s.block_end
                toks = s.tokens[s.kv_upto : end]
                table = self.block_pages.rows[s.request_id].table
                rows.append(
                    RowQuery(toks, s.kv_upto, end, s.window_start, None, s.layout.block, table)
                )
                continue
            slot = self.slots[s.request_id] if s.slot_cached else None
            if not s.slot_cached or s.refreshing:
                rows.append(RowQuery(s.tokens, 0, s.length, s.window_start, slot))
            elif s.multi is not None:  # d3LLM's delayed cache: the suffix from the cache's end
                start = s.prompt_len + s.multi.cache_step()[1]
                rows.append(RowQuery(s.tokens[start:], start, s.length, s.window_start, slot))
            else:
                start = s.window_start - self.shift
                end = s.window_start + s.window_width if s.params.cache == "dual" else s.length
                rows.append(RowQuery(s.tokens[start:end], start, s.length, s.window_start, slot))
        for s in seqs:
            if s.params.cfg_scale > 0:
                un = s.tokens.clone()
                un[: s.prompt_len] = self.mask_id
                rows.append(RowQuery(un, 0, s.length, s.window_start))
        return rows

    def _window_logits(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [rows, width, V] of every row's window and its current window tokens, from
        one forward over the packed query tokens of all rows (dlm_engine/ragged.py)."""
        width = max(s.window_width for s in seqs)
        if any(s.multi is not None or s.mbd is not None for s in seqs):  # widths vary: bucket
            width = round_up(width, self.length_multiple)
        fast = _fast_dllm_rows(seqs)
        if fast:
            self._ensure_slots(fast)
            self.refreshes += any(s.refreshing for s in fast)
            self.span_steps += any(not s.refreshing for s in fast)
        pool = self.pool if fast else None
        blocks = [s for s in seqs if s.paged]
        for s in blocks:  # pages up to the active block's end, from the row's reservation
            self.block_pages.grow(s)
        pages = self.block_pages.pool if blocks else None
        queries = self._queries(seqs)
        rows_key = plan_key(queries)
        made_for = None
        if rows_key is not None:
            made_for = (rows_key, width, self._pool_id(), pool.length if pool else 0,
                        self.graphs is not None, self.length_multiple)  # fmt: skip
        ahead = self._take_lookahead(made_for, seqs)
        if ahead is not None:  # queued by the last step, over these very rows
            self._last_plan = (made_for, ahead.plan)
            self._count_forward(ahead.plan, width)
            return ahead.logits, ahead.current
        last = self._last_plan
        if made_for is not None and last is not None and last[0] == made_for:
            plan = with_new_tokens(last[1], queries, self.pad_id)
            self.plan_reuses += 1
        else:
            plan = plan_packed(
                queries,
                width=width,
                shift=self.shift,
                pad_id=self.pad_id,
                device=self.device,
                pool=pool,
                bucket=self.graphs is not None,
                query_multiple=self.length_multiple,
                pages=pages,
                paged_attention=self.paged_attention,
            )
        self._last_plan = (made_for, plan) if made_for is not None else None
        self._count_forward(plan, width)
        return self._forward(seqs, plan, width, pool, pages)

    def _count_forward(self, plan: PackedPlan, width: int) -> None:
        self.forward_passes += 1
        self.work["tokens"] += plan.tokens
        self.work["attn_pairs"] += plan.attn_pairs
        self.work["logit_positions"] += plan.rows * width

    def _forward(
        self,
        seqs: list[Sequence],
        plan: PackedPlan,
        width: int,
        pool: KVPool | None,
        pages: PagePool | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the packed forward of `plan`, the output head at every row's window and
        classifier-free guidance's mix: (logits, current window tokens)."""
        blocks = [s for s in seqs if s.paged]
        fn = packed_forward_fn(self.model, pool, width, plan.layout, pages)
        key = ("packed", self._pool_id(), width, plan.layout)
        hidden = self._run(key, fn, plan.inputs, plan.layout)[: plan.rows]
        for s in blocks:  # a prefill: its whole prompt pages are final now, index them
            if not s.forwards:
                self.block_pages.prefilled(s)
        logits = self.model.head(hidden)
        b = len(seqs)
        current = plan.inputs["ids"][0][plan.current_index[:b]]
        cfg = [i for i, s in enumerate(seqs) if s.params.cfg_scale > 0]
        if cfg:
            sel = to_device(cfg, self.device)
            scale = to_device([seqs[i].params.cfg_scale for i in cfg], self.device, logits.dtype)
            cond, uncond = logits[sel], logits[b:]
            logits = logits[:b].clone()
            logits[sel] = uncond + (scale[:, None, None] + 1) * (cond - uncond)
        return logits, current

    # ---- the next step's forward, queued early (dlm_engine/lookahead.py) --------------------
    def _take_lookahead(self, made_for: tuple | None, seqs: list[Sequence]) -> Lookahead | None:
        """The forward queued ahead for these rows and this plan key, else None (dropped)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if made_for is not None and ahead.made_for == made_for and ahead.holds(seqs):
            self.lookahead_taken += 1
            return ahead
        self.lookahead_dropped += 1
        return None

    def holds_lookahead_for(self, seqs: list[Sequence]) -> bool:
        """A forward waits ahead for exactly these rows (the engine then admits nobody this
        step, so that it is taken, not dropped)."""
        return self._ahead is not None and self._ahead.holds(seqs)

    def drop_lookahead(self) -> None:
        if self._ahead is not None:
            self._ahead = None
            self.lookahead_dropped += 1

    def _can_look_ahead(self, seqs: list[Sequence]) -> bool:
        """This step's plan can serve the next step (plan key known, graph replayed on CUDA:
        an eager forward's launches would hold the host up) and every row stays in its block."""
        if not self.lookahead or self._last_plan is None:  # None: no plan key (block rows)
            return False
        if self.device.type == "cuda" and not self._last_graphed:
            return False
        return all(stays_in_block(s) for s in seqs)

    def _look_ahead(self, seqs: list[Sequence]) -> None:
        """Queue the next step's forward now: the same rows and positions, over the tokens
        this step's commit has just written on the device."""
        made_for, plan = self._last_plan
        width = plan.current_index.shape[1]  # [rows, width]: the window it was made for
        pool = self.pool if _fast_dllm_rows(seqs) else None
        plan = with_new_tokens(plan, self._queries(seqs), self.pad_id)
        logits, current = self._forward(seqs, plan, width, pool, None)
        ids = tuple(s.request_id for s in seqs)
        self._ahead = Lookahead(made_for, ids, plan, logits, current)

    def _copy_looking_ahead(self, seqs: list[Sequence], rows: torch.Tensor) -> list[list[int]]:
        """The step's one copy, with the next step's forward queued behind it: the host waits
        for the copy only (an event), and the device runs the next forward meanwhile."""
        if self.device.type != "cuda":
            self._look_ahead(seqs)
            return rows.tolist()
        pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        pinned.copy_(rows, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))  # the copy's stream, on its GPU
        self._look_ahead(seqs)
        copied.synchronize()  # the one copy (the next forward keeps the device busy)
        return pinned.tolist()

    # ---- block rows' pages --------------------------------------------------------
    def use_pages(
        self,
        block: int,
        *,
        tokens: int,
        memory_fraction: float,
        cpu_tokens: int,
        prefix_cache_tokens: int,
    ) -> None:
        """Make the page pool of block-diffusion rows (sizing: dlm_engine/paged_kv.py) and,
        with `prefix_cache_tokens` > 0, its prefix cache."""
        n_layers, kv, head_dim, dtype = self._kv_dims()
        pt = page_size(block)
        per_token = 2 * n_layers * kv * head_dim * torch.empty((), dtype=dtype).element_size()
        n = pool_pages(
            page_tokens=pt,
            bytes_per_token=per_token,
            device=self.device,
            tokens=tokens,
            memory_fraction=memory_fraction,
            cpu_tokens=cpu_tokens,
        )
        idle = prefix_cache_tokens // pt
        pool = PagePool(n_layers, n, pt, kv, head_dim, dtype, self.device, idle_limit=idle)
        cache = PrefixCache(pool) if prefix_cache_tokens > 0 else None
        self.block_pages = BlockPages(pool, cache, self.shift)
        if self.paged_attention == "flex" and not paged_flex.supported(pt, self.device):
            log.warning("paged_attention flex: no kernel tile fits %d-token pages, gathering", pt)
            self.paged_attention = "gather"
        log.info(
            "block-diffusion KV pages: %d of %d tokens (%.2f GiB), prefix cache %s",
            n,
            pt,
            pool.nbytes / 2**30,
            f"up to {idle * pt} idle tokens" if cache else "off",
        )

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.block_pages.cache if self.block_pages is not None else None

    def admit(self, seq: Sequence) -> bool:
        """Scheduler hook: a block row joins only with its pages reserved (else it waits)."""
        if not seq.paged or self.block_pages is None:
            return True
        return self.block_pages.admit(seq)

    def fits_pool(self, seq: Sequence) -> bool:
        """A block row's worst case fits the whole pool (else it could never run)."""
        bp = self.block_pages
        return not seq.paged or bp is None or bp.worst_case(seq) <= bp.pool.pages

    # ---- KV pool ----------------------------------------------------------------------------
    def _pool_id(self) -> int:
        return id(self.pool) if self.pool is not None else 0

    def _ensure_slots(self, seqs: list[Sequence]) -> None:
        need = max(s.length for s in seqs)
        if self.pool is None or need > self.pool.length:
            length = round_up(need, 64)
            if self.pool is None:
                n_layers, kv, head_dim, dtype = self._kv_dims()
                self.pool = KVPool(
                    n_layers, self.max_rows, kv, head_dim, length, dtype, self.device
                )
            else:
                self.pool = self.pool.grown(length)
            if self.graphs is not None:
                self.graphs.clear()
        for s in seqs:
            if s.request_id not in self.slots:
                self.slots[s.request_id] = self.pool.allocate()

    def _kv_dims(self) -> tuple[int, int, int, torch.dtype]:
        """(layers, kv heads, head dim, dtype) of the model's keys and values."""
        m = self.model
        a = m.arch
        n_layers = getattr(a, "n_layers", None) or a.num_hidden_layers
        heads = getattr(a, "n_heads", None) or a.num_attention_heads
        kv = getattr(a, "n_kv_heads", None) or a.num_key_value_heads
        hidden = getattr(a, "d_model", None) or a.hidden_size
        dtype = next(p.dtype for p in m.parameters() if p.is_floating_point())
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.bfloat16
        head_dim = int(getattr(m, "head_dim", 0) or hidden // heads)  # Qwen3: explicit
        return n_layers, kv, head_dim, dtype

    def release(self, request_id: str) -> None:
        """Give a finished, aborted or failed request's cache row or pages back."""
        slot = self.slots.pop(request_id, None)
        if slot is not None and self.pool is not None:
            self.pool.release(slot)
        if self.block_pages is not None:
            self.block_pages.release(request_id)

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seqs: list[Sequence], look_ahead: bool = True) -> list[list[int]]:
        """Run one step for all rows; returns each row's window after this step's commits.
        With `look_ahead` (the engine's say: no request waits to join) and rows that all stay
        in their block, the next step's forward is queued before the copy."""
        dev = self.device
        # the forward first: everything below only reads its logits, and every small tensor
        # it builds is staged through pinned memory (no host wait), so the host prepares the
        # commit while the device runs the forward instead of the device waiting for the host
        logits, current = self._window_logits(seqs)
        widths = to_device([s.window_width for s in seqs], dev)
        rows = [
            RowDecode(
                width=s.window_width,
                confidence=s.rule.confidence,
                temperature=s.params.temperature,
                top_p=s.params.top_p,
                top_k=s.params.top_k,
                suppress_eos=s.params.suppress_eos,
                generator=s.generator,
            )
            for s in seqs
        ]
        index = RowIndex.build(rows, dev)
        plan = CommitPlan([row_rule(s) for s in seqs], dev)
        k = plan.k
        constrained = (
            ConstrainedStep(self.constraint_runtime, seqs) if self.constraint_runtime else None
        )
        guard = RowGuard(len(seqs), dev)
        from .decoding.logprobs import LogprobStep

        logprobs = LogprobStep.build(seqs, dev)  # only rows that ask
        if logprobs:  # before anything below edits the logits in place
            logprobs.capture(logits)
        bias = LogitBiasStep.build(seqs, dev)  # OpenAI's logit_bias: only rows that carry one
        if bias:  # before grammar masks, the commit rule's scores and the proposals read them
            bias.apply(logits)
        if constrained:  # grammar rows: masks on the CPU while the forward runs, then in order
            constrained.prepare()  # a failed matcher fails its row alone
            forced = constrained.commit(logits, current)
            guard.errors.update(constrained.failed)
        valid = torch.arange(logits.shape[1], device=dev)[None, :] < widths[:, None]
        masked = (current == self.mask_id) & valid
        stale = _early_stop_stale(seqs, masked.shape[1])
        if stale is not None:  # early stop's fill: still candidates this step (as d3LLM)
            masked |= to_device(stale, dev) & valid
        extra = {} if plan.simple else plan.scores(logits)  # before propose edits logits
        if plan.joint is not None:  # token editing reads the window's decoded tokens
            extra["current"], extra["decoded"] = current, ~masked & valid
        if plan.mbd is not None:  # Diffulex forbids the mask: confidences renormalised
            logits[:, :, self.mask_id].index_fill_(0, plan.mbd, -torch.inf)  # no host wait
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
        rows_out = torch.cat([new, ok[:, None].to(new.dtype)], dim=1)
        if look_ahead and self._can_look_ahead(seqs):
            host = self._copy_looking_ahead(seqs, rows_out)
        else:
            host = rows_out.cpu().tolist()  # the one copy
        self.failed_rows = guard.messages([bool(row[-1]) for row in host])
        if logprobs:
            logprobs.record(new, current, ok, self.mask_id)
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
            if s.rule.draws_positions:

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


def _early_stop_stale(seqs: list[Sequence], width: int) -> list[list[bool]] | None:
    """Multi-block rows whose early stop has just filled masks after end-of-text: per row,
    which window positions were masks before the fill (None when no row has any)."""
    if not any(s.multi is not None and s.multi.stale for s in seqs):
        return None
    out = []
    for s in seqs:
        row = [False] * width
        if s.multi is not None:
            lo = s.window_start - s.prompt_len
            for pos in s.multi.stale:
                if lo <= pos < lo + s.window_width:
                    row[pos - lo] = True
        out.append(row)
    return out
