"""DiffusionGemma over several ranks: tensor parallel, or its experts spread (expert parallel).

Tensor parallel (`sharding.py`, the family's `GEMMA_RULES`): each rank holds 1/N of every
layer's query and key/value heads, of its dense MLP and of every routed expert's intermediate
size; the attention output, the dense MLP and the experts are each summed over the ranks
(three all-reduces a layer: each is normed before they meet). Each rank's row caches hold its
own key/value heads only (they take the shape of its keys).

Expert parallel (`expert_parallel`): attention and dense MLPs stay whole on every rank; each
rank holds num_experts / N of every layer's stacked experts (`LocalExperts`, sliced by
expert as the checkpoint stores them), runs them as grouped GEMMs on the (token, expert)
pairs routed to them and sums the ranks' outputs with one all-reduce per layer. Either way
the router is replicated, so every rank routes every token alike.

Rank 0's `ParallelGemma` stands where the model stands for `UniformRunner`: `encode` and
`decode_hidden` first send the workers the call (`channel.py`) and then run rank 0's copy; the
workers keep a mirror of every row's encoder cache (by a number rank 0 gives each
`RowCache`) and drop it once rank 0's is gone. The self-conditioning embedding and the output
head read only replicated weights: rank 0 runs them alone. A decoder step that repeats
(`DecodeGraph`) replays a CUDA graph on every rank, in lockstep (`GemmaGraphs`, `graphs.py`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..cuda_graphs import Inputs
from ..models.moe import in_out, run_experts
from .channel import Channel
from .graphs import ParallelGraphs, WorkerGraphs


def _gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class LocalExperts(nn.Module):
    """A rank's slice of one layer's stacked experts — model experts `first` .. `first` + n - 1
    under the published names (`gate_up_proj` [n, 2I, H], `down_proj` [n, H, I]) — whose
    output is summed over the ranks."""

    def __init__(self, experts: nn.Module, rank: int, world: int, group=None) -> None:
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        if total % world:
            raise ValueError(
                f"tensor_parallel_size {world} does not divide num_experts ({total}) under "
                "expert_parallel"
            )
        n = total // world
        like = experts.gate_up_proj  # made where the model was built (meta while loading)
        self.gate_up_proj = nn.Parameter(torch.empty(n, *like.shape[1:], device=like.device))
        self.down_proj = nn.Parameter(
            torch.empty(n, *experts.down_proj.shape[1:], device=like.device)
        )
        self.first = rank * n
        self.group = group

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
        out = run_experts(
            x,
            index,
            weights,
            in_out(self.gate_up_proj),  # a tensor, or FP8 experts after quantization
            in_out(self.down_proj),
            first_expert=self.first,
            act=_gelu_mul,
        )
        dist.all_reduce(out, group=self.group)
        return out


class _CacheIds:
    """A number for each of rank 0's row caches, and the numbers of those since dropped."""

    def __init__(self) -> None:
        self.next = 0
        self.dropped: list[int] = []

    def of(self, cache: Any) -> int:
        cid = getattr(cache, "_parallel_id", None)
        if cid is None:
            cid = cache._parallel_id = self.next
            self.next += 1
            weakref.finalize(cache, self.dropped.append, cid)
        return cid

    def take_dropped(self) -> list[int]:
        dropped, self.dropped = self.dropped, []
        return dropped


class GemmaGraphs(ParallelGraphs):
    """Rank 0's decoder-step graph under several ranks (`DecodeGraph`'s cache): each capture
    or replay first sends the workers a `gemma_graph` command naming the rows' caches, so
    every rank captures, and replays, its own decoder step with the collectives inside."""

    def __init__(self, model: ParallelGemma, device: torch.device) -> None:
        super().__init__(model, device, max_graphs=1, warmups=0)  # as DecodeGraph's own

    def run(self, key: tuple, fn, inputs: Inputs) -> torch.Tensor:
        header = self.command("gemma_graph", key, inputs)
        header["caches"] = [self.lm._cache_header(c) for c in fn.caches]
        return self.lm._call(header, list(inputs.values()), lambda: self.cache.run(key, fn, inputs))


class ParallelGemma(nn.Module):
    """Rank 0's DiffusionGemma over several ranks (see the module's docstring)."""

    logits_shift = 0

    def __init__(self, local: nn.Module, channel: Channel, workers) -> None:
        super().__init__()
        self.local = local
        self.channel = channel
        self.workers = workers  # workers.WorkerSet
        self.arch = local.arch
        self.embed_scale = local.embed_scale
        self.ids = _CacheIds()
        self.broken: str | None = None

    # what the runner and the sampler read of the model
    @property
    def model(self) -> nn.Module:
        return self.local.model

    @property
    def vocab_size(self) -> int:
        return int(self.local.vocab_size)

    @property
    def canvas_length(self) -> int:
        return int(self.local.canvas_length)

    @property
    def world(self) -> int:
        return self.workers.world

    def fuse_projections(self) -> None:
        """Nothing to fuse (as the model itself)."""

    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        return self.local.soft_embedding(logits)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.local.head(h)

    def fault(self) -> str | None:
        """Why no forward can run any more (`model.group_fault`), or None."""
        from .model import group_fault

        return group_fault(self)

    def _call(self, header: dict[str, Any], tensors: list[torch.Tensor], run):
        from .model import FAILED_FORWARD_GRACE_S, TensorParallelError

        self.workers.check()
        if self.broken is not None:
            raise TensorParallelError(
                f"an earlier parallel DiffusionGemma forward failed ({self.broken})"
            )
        header["drop"] = self.ids.take_dropped()
        try:
            self.channel.send(header, tensors)
            return run()
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            self.workers.check(grace_s=FAILED_FORWARD_GRACE_S)  # a dead worker: the cause
            raise TensorParallelError(f"parallel DiffusionGemma forward failed: {exc}") from exc

    def _cache_header(self, cache) -> list[int]:
        return [self.ids.of(cache), int(getattr(cache, "room", 0)), len(cache.keys)]

    @torch.no_grad()
    def encode(self, spans: list) -> None:
        header = {
            "cmd": "gemma_encode",
            "caches": [self._cache_header(cache) for _, cache in spans],
        }
        tensors = [ids for ids, _ in spans]
        self._call(header, tensors, lambda: self.local.encode(spans))

    @torch.no_grad()
    def decode_hidden(self, canvas: torch.Tensor, soft: list, caches: list) -> torch.Tensor:
        header = {
            "cmd": "gemma_decode",
            "caches": [self._cache_header(c) for c in caches],
            "soft": [s is not None for s in soft],
        }
        tensors = [canvas] + [s for s in soft if s is not None]
        return self._call(header, tensors, lambda: self.local.decode_hidden(canvas, soft, caches))

    def decode_graph_cache(self, device: torch.device) -> GemmaGraphs:
        """The cache `DecodeGraph` keeps its graph in: the workers capture and replay theirs
        alongside."""
        return GemmaGraphs(self, device)

    def decode_core(self, ids, signal, offsets, caches) -> torch.Tensor:
        """Rank 0's decoder step over its shard: only inside a `GemmaGraphs` run, which has
        told the workers to run theirs."""
        return self.local.decode_core(ids, signal, offsets, caches)

    def close(self) -> None:
        """Stop and reap the workers and leave the process group."""
        self.workers.stop()


class GemmaWorker:
    """A worker rank of DiffusionGemma: its shard of the model and a mirror of each of rank
    0's row caches (its own key/value heads under tensor parallel)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        from ..models.diffusion_gemma import RowCache

        self.model = model
        self.device = device
        self.row_cache = RowCache
        self.caches: dict[int, Any] = {}
        self.graphs = WorkerGraphs(device, warmups=0)  # rank 0's decoder graph, in lockstep

    def _cache(self, spec: list[int]):
        cid, room, layers = spec
        if cid not in self.caches:
            self.caches[cid] = self.row_cache(layers, room=room)
        return self.caches[cid]

    @torch.inference_mode()
    def run(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        for cid in header.get("drop", ()):
            self.caches.pop(cid, None)
        if header["cmd"] == "gemma_encode":
            caches = [self._cache(spec) for spec in header["caches"]]
            self.model.encode(list(zip(tensors, caches, strict=True)))
            return
        if header["cmd"] == "gemma_graph":
            caches = [self._cache(spec) for spec in header["caches"]]
            inputs = dict(zip(header["names"], tensors, strict=True))
            key = self.graphs.follow(header, inputs)

            def step(static: dict[str, torch.Tensor]) -> torch.Tensor:
                return self.model.decode_core(
                    static["ids"], static["signal"], static["offsets"], caches
                )

            self.graphs.cache.run(key, step, inputs)
            return
        if header["cmd"] != "gemma_decode":
            raise ValueError(f"unknown command {header['cmd']!r} for a DiffusionGemma worker")
        given = iter(tensors[1:])
        soft = [next(given) if has else None for has in header["soft"]]
        caches = [self._cache(spec) for spec in header["caches"]]
        self.model.decode_hidden(tensors[0], soft, caches)
