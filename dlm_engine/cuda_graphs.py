"""CUDA graphs for the batched forwards: one captured graph per padded shape.

At batch 1 a step of an 8B model is bound by kernel launches, not by the GPU (see
docs/benchmarks.md). Replaying a captured graph removes them. The caller pads every input to
its bucket itself (`bucket_rows`, `round_up`: it knows what padding means for each input);
this cache copies the inputs into the graph's static buffers and replays.

On a device without CUDA graphs (the CPU) a "graph" is the recorded forward run again over
its static inputs (`EagerGraph`): the cache's bookkeeping (keys, eviction, static inputs) is
the same, which is how tensor parallel's graphs on every rank (dlm_engine/parallel/graphs.py)
are tested on CPU ranks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)

Inputs = dict[str, torch.Tensor]


def bucket_rows(n: int) -> int:
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    return -(-n // 16) * 16


def worth_a_graph(packed_tokens: int, whole_sequences: bool, max_tokens: int) -> bool:
    """Replay (capturing first) a graph for a forward? Not for one that feeds whole sequences
    (exact rows, cached rows at a block start) over more than `max_tokens` packed tokens
    (0: no limit): past the limit the GPU's arithmetic outlasts the eager forward's host
    launches, its shape (rows x lengths) rarely repeats, and a capture costs far more than an
    eager forward (docs/benchmarks.md). In-block steps have few shapes (rows x block width) and are
    launch-bound: always graphed."""
    return not (whole_sequences and max_tokens and packed_tokens > max_tokens)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class EagerGraph:
    """A CPU stand-in for `torch.cuda.CUDAGraph`: `replay` runs the forward again over the
    static inputs and writes the static output."""

    def __init__(self, fn: Callable[[Inputs], torch.Tensor], inputs: Inputs, out: torch.Tensor):
        self.fn, self.inputs, self.out = fn, inputs, out

    def replay(self) -> None:
        with torch.inference_mode():
            self.out.copy_(self.fn(self.inputs))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | EagerGraph
    inputs: Inputs
    out: torch.Tensor
    # the tensor each static input was last copied from: a step that reuses its plan passes
    # the same index tensors again (never written after they are made), so only its new
    # tokens need a copy
    fed: dict[str, torch.Tensor] = field(default_factory=dict)


class GraphCache:
    """Captures `fn(static_inputs)` once per key and input shapes; replays it afterwards."""

    def __init__(
        self,
        device: torch.device,
        max_graphs: int = 24,
        warmups: int = 1,
        capture_error_mode: str = "global",
    ) -> None:
        self.device = device
        self.max_graphs = max_graphs
        # "thread_local" under tensor parallel: NCCL's watchdog thread queries its events
        # while a rank captures, which "global" would count against the capture
        self.capture_error_mode = capture_error_mode
        # eager runs before a capture, on a side stream: the first run of a new shape may
        # compile or autotune the compiled pieces, which must not happen under capture; a
        # second run finds nothing more to do and only costs time (benchmarks/capture_cost.py)
        self.warmups = warmups
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0
        # One memory pool for every captured graph: they replay one at a time on one stream,
        # so their activations can share memory; a graph's output stays valid until another
        # graph replays (the caller consumes it first), so many shapes fit in little memory.
        self.mempool = None

    def clear(self) -> None:
        """Drop every graph (their inputs moved, e.g. a new KV pool). Their shared memory pool
        goes with them: the next capture opens a new one (PyTorch asserts when a capture uses
        a pool whose graphs were all released)."""
        self.graphs.clear()
        self.mempool = None

    @staticmethod
    def full_key(key: tuple, inputs: Inputs) -> tuple:
        """The cache's key of one graph: the caller's key and the inputs' shapes."""
        return (key, tuple((n, tuple(t.shape)) for n, t in inputs.items()))

    def will_capture(self, key: tuple, inputs: Inputs) -> bool:
        """Whether `run(key, ..., inputs)` captures (no graph of these shapes is held): under
        tensor parallel every rank must capture, or replay, together."""
        return self.full_key(key, inputs) not in self.graphs

    def drop(self, key: tuple, inputs: Inputs) -> None:
        """Forget one graph (the next `run` of its key and shapes captures it again)."""
        self.graphs.pop(self.full_key(key, inputs), None)

    def run(
        self,
        key: tuple,
        fn: Callable[[Inputs], torch.Tensor],
        inputs: Inputs,
    ) -> torch.Tensor:
        """Replay (capturing first) the graph of `fn` for these input shapes; the caller has
        padded every input to its bucket, so the shapes are part of the key as they are."""
        full_key = self.full_key(key, inputs)
        entry = self.graphs.get(full_key)
        if entry is None:
            entry = self._capture(full_key, fn, inputs)
        self.graphs.move_to_end(full_key)
        for name, value in inputs.items():
            if entry.fed.get(name) is not value:
                entry.inputs[name].copy_(value)
                entry.fed[name] = value
        entry.graph.replay()
        return entry.out

    def _capture(self, key: tuple, fn, inputs: Inputs) -> _Captured:
        static = {n: t.clone() for n, t in inputs.items()}
        if self.device.type != "cuda":
            with torch.inference_mode():
                out = fn(static)
            return self._keep(key, _Captured(EagerGraph(fn, static, out), static, out))
        # `torch.cuda.graph` captures on a stream of the thread's current device: a model on
        # another GPU than the current one (a data-parallel replica on cuda:1) would record an
        # empty graph, so the capture runs with the model's device current
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(self.warmups):  # warm up on a side stream, as capture requires
                    fn(static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.mempool is None:
                self.mempool = torch.cuda.graph_pool_handle()
            with (
                torch.inference_mode(),
                torch.cuda.graph(
                    graph, pool=self.mempool, capture_error_mode=self.capture_error_mode
                ),
            ):
                out = fn(static)
        return self._keep(key, _Captured(graph, static, out))

    def _keep(self, key: tuple, entry: _Captured) -> _Captured:
        self.graphs[key] = entry
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return entry
