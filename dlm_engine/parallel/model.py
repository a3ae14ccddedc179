"""Rank 0's view of a tensor-parallel model, and what a worker does with each command.

`ParallelLM` stands where the model stands for the model runner, the scoring path and the
reference loops: the same `hidden_states`, `head` and `forward`, the same `arch` (with this
rank's key/value heads, so KV pools are sized per rank), `vocab_size` and `logits_shift`.
Each call first sends the workers the call's inputs (`channel.py`) and then runs this rank's
shard; the shards meet in the row-parallel all-reduces and the head's gather, so all ranks
run every forward in lockstep and rank 0 alone ends with full logits. KV pools live on every
rank with the same geometry: rank 0 sends their shapes, the workers keep mirrors, and the
index tensors of the packed plan address both alike. On CUDA the packed forwards are CUDA
graphs on every rank, captured and replayed together (`graphs.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..models.common import ForwardBatch, gather_positions
from ..ragged import GroupLayout, PackedAttention
from .channel import Channel
from .graphs import ParallelGraphs, WorkerGraphs

_BATCH_FIELDS = ("input_ids", "positions", "key_mask", "logits_index")


# after a failed forward, how long a worker's exit may trail the collective's error
FAILED_FORWARD_GRACE_S = 1.0


def group_fault(model: Any) -> str | None:
    """Why a rank-0 model (tensor or expert parallel) can run no forward until its group is
    restarted: a worker rank exited or a node lost one, or a forward failed part-way (the
    ranks may be out of step); None while it can. Cheap: polls the worker processes."""
    fault = model.workers.fault()
    if fault is None and model.broken is not None:
        fault = (
            f"a tensor-parallel forward failed part-way ({model.broken}); the ranks may be out of "
            "step, so this engine runs no forward until it is restarted"
        )
    return fault


class TensorParallelError(RuntimeError):
    """A rank stopped or failed: the engine cannot run a forward until it is restarted."""


def local_arch(arch: Any, model: nn.Module) -> Any:
    """The architecture with this rank's attention and key/value head counts."""
    attn = next(m for m in model.modules() if hasattr(m, "n_kv_heads"))
    changes = {}
    for field, value in (
        ("n_kv_heads", attn.n_kv_heads),
        ("num_key_value_heads", attn.n_kv_heads),
        ("n_heads", attn.n_heads),
        ("num_attention_heads", attn.n_heads),
    ):
        if hasattr(arch, field):
            changes[field] = value
    return dataclasses.replace(arch, **changes)


def encode_batch(batch: ForwardBatch) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A forward's inputs as a JSON header and a list of tensors (see `decode_batch`)."""
    names, tensors = [], []
    for name in _BATCH_FIELDS:
        t = getattr(batch, name)
        if t is not None:
            names.append(name)
            tensors.append(t)
    header: dict[str, Any] = {"cmd": "hidden", "layout": None, "pool": None, "pages": None}
    ctx = batch.kv
    if ctx is not None:
        if not isinstance(ctx, PackedAttention):
            raise TensorParallelError(f"no tensor-parallel forward for {type(ctx).__name__}")
        header["layout"] = [list(g) for g in ctx.layout]
        for key, t in ctx.x.items():
            names.append(f"x.{key}")
            tensors.append(t)
        if ctx.pool is not None:
            header["pool"] = list(ctx.pool.k[0].shape)
        if ctx.pages is not None:
            header["pages"] = list(ctx.pages.k[0].shape)
    header["names"] = names
    return header, tensors


class KVMirror:
    """A worker's copy of one of rank 0's KV pools: per-layer zeros of the same shape
    (`page_tokens` for the page pool); a longer Fast-dLLM pool keeps the old contents, as
    `KVPool.grown` does on rank 0."""

    def __init__(self, layers: int, shape: list[int], dtype: torch.dtype, device, old=None):
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.shape = list(shape)
        self.page_tokens = shape[1]
        if old is not None and old.shape[0] == shape[0]:
            n = min(old.shape[1], shape[1]) - 1  # the spare position stays zero
            for fresh, prev in zip(self.k + self.v, old.k + old.v, strict=True):
                fresh[:, :n].copy_(prev[:, :n])


class WorkerModel:
    """A worker rank: its shard, its KV mirrors, and one command at a time."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.layers = len(model.blocks())
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.pool: KVMirror | None = None
        self.pages: KVMirror | None = None
        self.graphs: WorkerGraphs | None = None  # made on rank 0's first graph command

    def _mirror(self, old: KVMirror | None, shape: list[int] | None) -> KVMirror | None:
        if shape is None:
            return old
        if old is not None and old.shape == shape:
            return old
        return KVMirror(self.layers, shape, self.dtype, self.device, old)

    @torch.inference_mode()
    def run(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Run one command's share of the forward (its outputs stay on rank 0)."""
        if header["cmd"] == "head":
            self.model.head(tensors[0])
            return
        given = dict(zip(header["names"], tensors, strict=True))
        self.pool = self._mirror(self.pool, header["pool"])
        self.pages = self._mirror(self.pages, header["pages"])
        pool = self.pool if header["pool"] is not None else None
        pages = self.pages if header["pages"] is not None else None
        if header["cmd"] == "graph":
            if self.graphs is None:
                self.graphs = WorkerGraphs(self.device)
            self.graphs.run(self.model, header, given, pool, pages)
            return
        ctx = None
        if header["layout"] is not None:
            x = {k.removeprefix("x."): t for k, t in given.items() if k.startswith("x.")}
            layout = tuple(GroupLayout(*g) for g in header["layout"])
            ctx = PackedAttention(x, pool, layout, pages)
        batch = ForwardBatch(*(given.get(n) for n in _BATCH_FIELDS), ctx)
        self.model.hidden_states(batch)


class ParallelLM(nn.Module):
    """Rank 0's model: sends each call to the workers, then runs its own shard."""

    def __init__(self, local: nn.Module, channel: Channel, workers) -> None:
        super().__init__()
        self.local = local
        self.channel = channel
        self.workers = workers  # workers.WorkerSet
        self.logits_shift = int(getattr(local, "logits_shift", 0))
        self.head_dim = local.head_dim
        self.rope_theta = local.rope_theta
        self.arch = local_arch(local.arch, local)
        # why a forward failed: the workers may still wait inside it, so later calls are
        # refused (restart the engine) instead of pairing with the wrong collectives
        self.broken: str | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.local.vocab_size)

    @property
    def world(self) -> int:
        return self.workers.world

    def fuse_projections(self) -> None:
        """Already fused on every rank when the shards loaded."""

    def graph_cache(self, device: torch.device, max_graphs: int) -> ParallelGraphs:
        """The model runner's CUDA-graph cache: graphs captured and replayed on every rank."""
        return ParallelGraphs(self, device, max_graphs)

    def blocks(self) -> nn.ModuleList:
        return self.local.blocks()

    def fault(self) -> str | None:
        """Why no forward can run any more (`group_fault`), or None."""
        return group_fault(self)

    def _call(self, header: dict[str, Any], tensors: list[torch.Tensor], run):
        self.workers.check()
        if self.broken is not None:  # the ranks may be out of step: never run on
            raise TensorParallelError(f"an earlier tensor-parallel forward failed ({self.broken})")
        try:
            self.channel.send(header, tensors)
            return run()
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            self.workers.check(grace_s=FAILED_FORWARD_GRACE_S)  # a dead worker is the clearer cause
            raise TensorParallelError(f"tensor-parallel forward failed: {exc}") from exc

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        header, tensors = encode_batch(batch)
        return self._call(header, tensors, lambda: self.local.hidden_states(batch))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        return self._call({"cmd": "head"}, [h], lambda: self.local.head(h))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.head(gather_positions(self.hidden_states(batch), batch.logits_index))

    def close(self) -> None:
        """Stop and reap the workers and leave the process group."""
        self.workers.stop()
