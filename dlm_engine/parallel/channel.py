"""What rank 0 tells the workers each forward: a small JSON header through the store (the
command, tensor shapes and dtypes, the attention layout, the KV pools' shapes) and then the
tensors themselves by `torch.distributed.broadcast` from rank 0, one flat broadcast per dtype.

A worker waits for the next header on the store in short rounds, checking between rounds
that rank 0 still lives: an idle engine never makes a collective time out. Headers are JSON,
never pickles, so nothing read from the store is executed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

POLL = timedelta(seconds=1)  # a worker's wait for the next header, between liveness checks
# headers kept on the store: rank 0's host may run a few commands ahead of a worker's (a
# queued next forward, a graph capture on the worker), and a header deleted before a worker
# read it would leave that worker waiting for ever; rank 0 waits on the device (and so on
# every worker) at least once a step, a few commands at most
KEEP = 64


class Channel:
    """Numbered commands from rank 0 (`send`) to every worker (`receive`)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.n = 0

    def send(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Post command n+1 and broadcast its tensors (rank 0)."""
        self.n += 1
        header = {**header, "tensors": [[list(t.shape), str(t.dtype)] for t in tensors]}
        self.store.set(f"cmd/{self.n}", json.dumps(header))
        if self.n > KEEP:  # long read by every worker
            self.store.delete_key(f"cmd/{self.n - KEEP}")
        for _, group in _by_dtype([t.dtype for t in tensors]):  # one broadcast per dtype
            dist.broadcast(torch.cat([tensors[i].reshape(-1) for i in group]), src=0)

    def receive(
        self, device: torch.device, alive: Callable[[], bool]
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """The next command and its tensors (a worker); None once `alive()` says rank 0 is
        gone."""
        key = f"cmd/{self.n + 1}"
        while True:
            try:
                self.store.wait([key], POLL)
                break
            except dist.DistError:  # a timeout, or the store gone with rank 0
                if not alive():
                    return None
        self.n += 1
        header = json.loads(self.store.get(key))
        shapes = [shape for shape, _ in header["tensors"]]
        dtypes = [getattr(torch, d.removeprefix("torch.")) for _, d in header["tensors"]]
        tensors: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
        for dtype, group in _by_dtype(dtypes):
            sizes = [math.prod(shapes[i]) for i in group]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(flat, src=0)
            for i, part in zip(group, flat.split(sizes), strict=True):
                tensors[i] = part.view(shapes[i])
        return header, tensors


def _by_dtype(dtypes: list[torch.dtype]) -> list[tuple[torch.dtype, list[int]]]:
    """Tensor indices grouped by dtype, in order of first appearance: rank 0 and the workers
    derive the same groups from the header's order."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, d in enumerate(dtypes):
        groups.setdefault(d, []).append(i)
    return list(groups.items())
