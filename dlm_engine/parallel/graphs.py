"""CUDA graphs under tensor parallel: every rank captures the same forwards, with the NCCL
collectives inside, and replays them together.

A graph replays kernels, not Python: a captured forward would not send the workers its
inputs. So rank 0 sends them before it captures or replays (`ParallelGraphs.run`: the
forward's layout, its KV pools' shapes, the graph's key and whether it is new, then the static
inputs by broadcast), and each worker runs the same `packed_forward_fn` over its shard and its
KV mirrors through its own `GraphCache` (`WorkerGraphs`). NCCL pairs collectives by order, so
the ranks must capture (warm-up and capture run the collectives eagerly and record them) and
replay in lockstep: rank 0 decides, a worker follows — it captures when told, and its cache
evicts as rank 0's does (the same size, the same order of keys), and drops everything when
rank 0's does (a new `epoch`: the KV pool moved).

DiffusionGemma's decoder steps use the same lockstep (`gemma.GemmaGraphs`): one graph kept,
the rows' caches named as `gemma_decode` names them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cuda_graphs import GraphCache, Inputs
from ..ragged import GroupLayout, packed_forward_fn


class GraphsOutOfStep(RuntimeError):
    """A worker was told to replay a graph it does not hold (its cache left rank 0's)."""


def _shape(pool) -> list[int] | None:
    return None if pool is None else list(pool.k[0].shape)


class ParallelGraphs:
    """Rank 0's graph cache under tensor parallel (`GraphCache`'s interface for the model
    runner): each run first tells the workers which graph to capture or replay."""

    def __init__(self, lm, device: torch.device, max_graphs: int, warmups: int = 1) -> None:
        self.lm = lm  # model.ParallelLM, or gemma.ParallelGemma (`GemmaGraphs`)
        self.cache = GraphCache(
            device, max_graphs, warmups=warmups, capture_error_mode="thread_local"
        )
        self.epoch = 0

    @property
    def graphs(self):
        return self.cache.graphs

    @property
    def captures(self) -> int:
        return self.cache.captures

    def clear(self) -> None:
        self.cache.clear()
        self.epoch += 1

    def command(self, cmd: str, key: tuple, inputs: Inputs) -> dict[str, Any]:
        """What every graph command tells a worker: which graph (rank 0's key, as text: a
        key holds rank-local values), whether it is new, the cache's size and epoch, and the
        static inputs' names (their tensors follow the header)."""
        return {
            "cmd": cmd,
            "key": repr(key),
            "epoch": self.epoch,
            "capture": self.cache.will_capture(key, inputs),
            "max_graphs": self.cache.max_graphs,
            "names": list(inputs),
        }

    def run(self, key: tuple, fn, inputs: Inputs) -> torch.Tensor:
        """Send the workers this forward's graph command, then capture or replay this rank's
        graph of the same forward over its own shard."""
        pool, width, layout, pages = fn.parts
        header = self.command("graph", key, inputs)
        header.update(
            width=width, layout=[list(g) for g in layout], pool=_shape(pool), pages=_shape(pages)
        )
        local = packed_forward_fn(self.lm.local, pool, width, layout, pages)
        return self.lm._call(
            header, list(inputs.values()), lambda: self.cache.run(key, local, inputs)
        )


class WorkerGraphs:
    """A worker's graphs: rank 0's, captured and replayed when rank 0 says."""

    def __init__(self, device: torch.device, warmups: int = 1) -> None:
        self.cache = GraphCache(device, warmups=warmups, capture_error_mode="thread_local")
        self.epoch = 0

    def follow(self, header: dict[str, Any], inputs: Inputs) -> tuple:
        """Take rank 0's decision for this command (`ParallelGraphs.command`): drop every
        graph on a new epoch, capture anew where rank 0 captures, and refuse to capture where
        rank 0 replays (the ranks would pair their collectives wrongly); the key to run."""
        if header["epoch"] != self.epoch:  # rank 0 dropped its graphs: so do we
            self.cache.clear()
            self.epoch = header["epoch"]
        self.cache.max_graphs = int(header["max_graphs"])
        key = (header["key"],)
        if header["capture"]:
            self.cache.drop(key, inputs)
        elif self.cache.will_capture(key, inputs):
            raise GraphsOutOfStep(f"rank 0 replays a graph this rank does not hold: {key[0]}")
        return key

    def run(self, model, header: dict[str, Any], inputs: Inputs, pool, pages) -> None:
        key = self.follow(header, inputs)
        layout = tuple(GroupLayout(*g) for g in header["layout"])
        fn = packed_forward_fn(model, pool, int(header["width"]), layout, pages)
        self.cache.run(key, fn, inputs)
