"""The engine's runner for DiffusionGemma rows: the `ModelRunner` surface the engine uses,
over `decoding/uniform_diffusion.py`'s per-row state.

Each step, what rows have to encode (new rows' prompts, finished canvases) runs as one packed
encoder forward of at most `encode_step_tokens` tokens (a longer prompt in chunks over
several steps), then every row with nothing left to encode takes one denoising step; a row's
window is empty until its canvas ends, then it is that whole canvas, which `Sequence` takes
into its host mirror, and None in a step where the row only encoded. Rows keep their own
encoder caches as plain tensors (no page pool). On the GPU the decoder step is replayed
from a CUDA graph while the batch and its caches stay the same (`DecodeGraph`). A row with structured output or a required
tool call gets its canvases constrained as they end (`decoding/uniform_constraints.py`); a row
whose matcher fails ends alone with its error.

A new row's longest cached prompt prefix (whole chunks of 256 tokens, same `cache_salt`) is
copied into its cache instead of being encoded, and the chunks it encodes itself are stored
once its prompt is in (`encoder_prefix.py`, `encoder_prefix_cache_bytes`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .decoding.uniform_constraints import CanvasConstraint
from .decoding.uniform_diffusion import UniformRow, denoise_rows, encode_rows
from .encoder_prefix import EncoderPrefixCache, auto_budget, fill
from .loader import LoadedModel
from .models.common import FusedKernels
from .models.diffusion_gemma import DecodeGraph, DiffusionGemmaModel
from .sequence import Sequence


class UniformRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        encode_step_tokens: int | None = None,
        prefix_cache_bytes: int | None = 0,
        fused_kernels: bool = True,
        cuda_graphs: bool = True,
    ) -> None:
        self.model = loaded.model
        self.encode_step_tokens = encode_step_tokens  # the encoder's budget a step (None: all)
        self.device = loaded.device
        self.shift = 0
        self.model_vocab = int(self.model.vocab_size)
        self.canvas_length = int(self.model.canvas_length)
        self.stops = torch.tensor(sorted(loaded.stop_ids), device=loaded.device)
        self.rows: dict[str, UniformRow] = {}
        self.failed_rows: dict[int, str] = {}
        self.constraint_runtime: Any = None
        self.block_pages = None
        # prompt prefixes shared across rows (None: off; `prefix_cache_bytes` None: auto).
        # Not across ranks (tensor or expert parallel): the workers' mirrors of the caches
        # would miss the copy
        if prefix_cache_bytes is None:
            prefix_cache_bytes = auto_budget(self.device)
        plain = isinstance(self.model, DiffusionGemmaModel)
        self.prefix_cache: EncoderPrefixCache | None = (
            EncoderPrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 and plain else None
        )
        self._chunk_hashes: dict[str, list[bytes]] = {}  # rows whose chunks are to be stored
        self.forward_passes = 0
        self.encoder_forwards = 0  # packed encoder forwards run (at most one a step)
        self.encoded_tokens = 0
        # the decoder step from a CUDA graph while the batch's caches stay the same (on every
        # rank under parallel: dlm_engine/parallel/gemma.py)
        graphs = self.device.type == "cuda" and cuda_graphs
        self.decode_graph = DecodeGraph(self.model) if graphs else None
        if self.device.type == "cuda" and fused_kernels:  # the sampler's statistics, fused
            FusedKernels.enabled = True

    @property
    def graph_captures(self) -> int:
        """Decoder CUDA graphs captured so far (`ModelRunner.graph_captures`)."""
        return self.decode_graph.captures if self.decode_graph is not None else 0

    # the scheduler's and engine's hooks; nothing to reserve or look ahead
    def admit(self, seq: Sequence) -> bool:
        return True

    def fits_pool(self, seq: Sequence) -> bool:
        return True

    def holds_lookahead_for(self, seqs: list[Sequence]) -> bool:
        return False

    def drop_lookahead(self) -> None:
        return None

    def release(self, request_id: str) -> None:
        self.rows.pop(request_id, None)
        self._chunk_hashes.pop(request_id, None)

    def shown_canvas(self, seq: Sequence) -> list[int]:
        """`stream_mode: denoise`'s canvas: the finished canvases and, while a canvas is being
        denoised, its tokens after this step (accepted and renoised alike, as the next step
        reads them); positions of canvases not begun are -1 (shown as null)."""
        canvas = list(seq.canvas)
        row = self.rows.get(seq.request_id)
        if row is None or row.done or row.current is None or row.to_encode is not None:
            return canvas  # no canvas in progress (none begun, or the last one just ended)
        start = row.canvases_done * self.canvas_length
        live = row.current[0, : max(0, len(canvas) - start)].tolist()
        canvas[start : start + len(live)] = live
        return canvas

    def _row(self, seq: Sequence) -> UniformRow:
        row = self.rows.get(seq.request_id)
        if row is None:
            settings = seq.params.uniform
            canvases = -(-seq.params.max_tokens // self.canvas_length)
            constraint = None
            if seq.constraint is not None:
                tools = seq.params.tools
                constraint = CanvasConstraint(
                    seq.constraint,
                    self.constraint_runtime,
                    seq.params.max_tokens,
                    closers=tools.format.closing_ids if tools is not None else (),
                )
            row = self.rows[seq.request_id] = UniformRow(
                torch.tensor(seq.prompt_ids, device=self.device),
                replace(settings, canvases=canvases),
                seed=seq.params.seed,
                n_layers=len(self.model.model.decoder.layers),
                canvas_length=self.canvas_length,
                vocab_size=self.model_vocab,
                stop_ids=self.stops,
                logprobs=seq.params.logprobs,
                constraint=constraint,
                logit_bias=seq.params.logit_bias,
            )
            self._reuse_prefix(seq, row)
        return row

    def _reuse_prefix(self, seq: Sequence, row: UniformRow) -> None:
        """Copy the prompt's longest cached prefix into the new row's cache (only the rest
        is left to encode) and have the whole chunks after it recorded as encoded."""
        cache = self.prefix_cache
        if cache is None or row.to_encode is None:
            return
        hashes = cache.hashes(seq.prompt_ids, seq.params.cache_salt)
        if not hashes:
            return
        layers = self.model.model.decoder.layers
        sliding = [layer.self_attn.shape.sliding for layer in layers]
        hit = fill(row.cache, cache.match(hashes), sliding, self.model.arch.sliding_window)
        seq.cached_tokens = hit
        if hit:
            row.take_span(hit)  # already in its cache
        if len(hashes) * cache.chunk_tokens > hit:
            row.cache.record_upto = len(hashes) * cache.chunk_tokens
            self._chunk_hashes[seq.request_id] = hashes

    def _store_prefixes(self, seqs: list[Sequence], rows: list[UniformRow]) -> None:
        """Store the recorded chunks of rows whose whole chunks are now encoded."""
        for seq, row in zip(seqs, rows, strict=True):
            hashes = self._chunk_hashes.get(seq.request_id)
            if hashes is None or row.cache.length < row.cache.record_upto:
                continue
            del self._chunk_hashes[seq.request_id]
            start = seq.cached_tokens // self.prefix_cache.chunk_tokens
            recorded = row.cache.take_recorded(
                (len(hashes) - start) * self.prefix_cache.chunk_tokens
            )
            if recorded is not None:
                self.prefix_cache.insert(hashes, *recorded, start)

    def step(self, seqs: list[Sequence], look_ahead: bool = True) -> list[list[int] | None]:
        """One step for every row: each row's finished canvas, [] while it goes on, or None
        where the row only encoded (no denoising step)."""
        self.failed_rows = {}
        rows = [self._row(s) for s in seqs]
        self.forward_passes += 1
        before = [row.forwards for row in rows]
        encoded = encode_rows(self.model, rows, self.encode_step_tokens)
        self.encoder_forwards += encoded > 0
        self.encoded_tokens += encoded
        if self._chunk_hashes and encoded:
            self._store_prefixes(seqs, rows)
        canvases = denoise_rows(self.model, rows, self.decode_graph)
        windows: list[list[int] | None] = []
        for i, (seq, row, canvas) in enumerate(zip(seqs, rows, canvases, strict=True)):
            windows.append(canvas or ([] if row.forwards > before[i] else None))
            if row.failure is not None:
                self.failed_rows[i] = row.failure
                continue
            if canvas and row.logprobs is not None:  # by canvas position, as Sequence keeps
                start = (row.canvases_done - 1) * self.canvas_length
                for k, entry in enumerate(row.canvas_logprobs):
                    if start + k < seq.params.max_tokens:
                        seq.logprobs[start + k] = entry
        return windows
