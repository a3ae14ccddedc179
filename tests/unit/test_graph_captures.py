"""The engine's count of CUDA-graph captures (`dlm_cuda_graph_captures_total`): a capture is
paid at the first step of each new shape, so under repeated traffic of one shape the count
stays put, and it rises when shapes change (a new row count, a KV pool that grew and dropped
every graph). On CPU `GraphCache` records each forward as an `EagerGraph` with the same
bookkeeping, so the counting is the GPU's."""

from __future__ import annotations

import pytest
import torch

from dlm_engine import Engine
from dlm_engine.cuda_graphs import GraphCache

DUAL = dict(max_tokens=16, steps=8, block_length=8, cache="dual")


@pytest.fixture
def graphed(engines: dict[str, Engine]):
    """The tiny LLaDA engine with a graph cache (bucketed shapes, as on a GPU)."""
    eng = engines["llada"]
    runner = eng.runner
    runner.graphs, runner.length_multiple = GraphCache(torch.device("cpu"), max_graphs=96), 8
    try:
        yield eng
    finally:
        runner.graphs, runner.length_multiple = None, 1


def _prompt(eng: Engine, words: int) -> list[int]:
    return eng.encode_prompt(messages=[{"role": "user", "content": "count " * words}])


def test_captures_count_new_shapes_only(graphed: Engine) -> None:
    runner = graphed.runner
    start = runner.graph_captures
    prompts = [_prompt(graphed, 3)] * 4
    graphed.generate(prompts, DUAL)
    first = runner.graph_captures - start
    assert first == len(runner.graphs.graphs) > 0  # one capture a shape, nothing evicted
    graphed.generate(prompts, DUAL)  # the same traffic again: every shape replays
    assert runner.graph_captures - start == first
    graphed.generate(prompts[:1], DUAL)  # one row: a new row bucket
    assert runner.graph_captures - start > first


def test_a_grown_pool_drops_its_graphs_and_captures_again(graphed: Engine) -> None:
    runner = graphed.runner
    graphed.generate([_prompt(graphed, 3)] * 2, DUAL)
    before = runner.graph_captures
    length = runner.pool.length
    graphed.generate([_prompt(graphed, 120)] * 2, DUAL)  # longer than the pool: it grows
    assert runner.pool.length > length
    assert runner.graph_captures > before


def test_a_failed_capture_keeps_the_count(graphed: Engine, monkeypatch) -> None:
    """A capture that fails turns graphs off for good; the count of those made stays."""
    runner = graphed.runner
    graphed.generate([_prompt(graphed, 3)] * 2, DUAL)
    made = runner.graph_captures
    assert made > 0

    def fail(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner.graphs, "run", fail)
    out = graphed.generate([_prompt(graphed, 5)], DUAL)[0]
    assert out.error is None and runner.graphs is None  # eager from now on
    assert runner.graph_captures == made
