"""Graphs on every rank under tensor parallel, on CPU: rank 0 tells the workers which graph to
capture or replay before it does (dlm_engine/parallel/graphs.py). On CPU a "graph" is the
recorded forward run again over its static inputs (`cuda_graphs.EagerGraph`), so the protocol
(keys, capture decisions, eviction in step with rank 0's, a new epoch when the KV pool moves,
static inputs fed anew each step) runs for real over a gloo group; it must give the tokens of
one device, with most forwards replayed rather than captured.
"""

from __future__ import annotations

import pytest
import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.parallel import ParallelLM
from dlm_engine.parallel.graphs import ParallelGraphs
from dlm_lab.testing import make_tiny_checkpoint
from dlm_lab.testing_diffusion_gemma import (
    SEEDED_ROWS,
    batch_tokens,
    chat_prompts,
    make_tiny_diffusion_gemma,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank_module")


def _graphed_tp2(path: str, max_graphs: int, **config) -> tuple[Engine, ParallelGraphs]:
    engine = Engine(EngineConfig(model=path, tensor_parallel_size=2, **config))
    model = engine.runner.model
    assert isinstance(model, ParallelLM)
    graphs = model.graph_cache(torch.device("cpu"), max_graphs)
    engine.runner.graphs = graphs  # the runner turns them on only on CUDA by itself
    return engine, graphs


def _tokens(engine: Engine, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize(
    ("family", "rows", "config"),
    [
        # Fast-dLLM dual cache: the KV pool grows (a new epoch: every rank drops its graphs)
        (
            "llada",
            [
                {"max_tokens": 24, "steps": 12, "cache": "dual", "block_length": 8},
                {"max_tokens": 16, "steps": 16},
                {"max_tokens": 8, "steps": 8, "cache": "prefix", "block_length": 4},
            ],
            {},
        ),
        # block diffusion over pages, experts spread whole over the ranks
        ("llada2", [{"max_tokens": 16}, {"max_tokens": 40}], {"expert_parallel": True}),
    ],
)
def test_graphs_on_every_rank_give_one_devices_tokens(tmp_path, family, rows, config) -> None:
    path = str(make_tiny_checkpoint(tmp_path / family, family, seed=2))
    one = Engine(EngineConfig(model=path))
    two, graphs = _graphed_tp2(path, max_graphs=3, **config)
    try:
        texts = ("Hello there, what is 2+2?", "Sort: 5 3 9 1", "abc")
        prompts = [one.encode_prompt(text=t) for t in texts][: len(rows)]
        assert _tokens(two, prompts[:1], rows[0]) == _tokens(one, prompts[:1], rows[0])
        assert _tokens(two, prompts, rows) == _tokens(one, prompts, rows)
        forwards = two.runner.forward_passes
        # graphs were captured, most forwards replayed one, and rank 0 evicted past 3
        # (the workers evict alike, or a replay would have found its graph missing)
        assert 3 < graphs.captures < forwards
        assert len(graphs.graphs) <= 3
        if family == "llada":
            assert graphs.epoch >= 1  # the pool moved at least once
    finally:
        two.runner.model.close()
    assert all(p.poll() is not None for p in two.runner.model.workers.procs)


def test_a_worker_behind_rank_0_still_reads_every_command() -> None:
    """Rank 0's host runs commands ahead of a worker's (a queued next forward while the worker
    still captures a graph: four commands before rank 0 waits on the device): every header
    stays readable until the worker has read it, in order."""
    import torch.distributed as dist

    from dlm_engine.parallel.channel import Channel

    store = dist.HashStore()
    rank0, worker = Channel(store), Channel(store)
    for i in range(40):  # tensors-less commands: nothing to broadcast, one process suffices
        rank0.send({"cmd": "head", "i": i}, [])
    got = [worker.receive(torch.device("cpu"), lambda: False) for _ in range(40)]
    assert [g[0]["i"] if g is not None else None for g in got] == list(range(40))


def test_diffusion_gemma_decoder_graphs_on_every_rank(tmp_path) -> None:
    """DiffusionGemma's decoder steps replayed from "graphs" on both ranks (experts spread
    over them): rank 0 names the rows' caches in each graph command, the worker captures and
    replays its own step in step with rank 0 (a worker that fell out of step would raise), a
    batch whose rows change drops the graph on both ranks; seeded rows give one device's
    tokens."""
    from dlm_engine.models.diffusion_gemma import DecodeGraph
    from dlm_engine.parallel.gemma import GemmaGraphs, ParallelGemma

    path = str(make_tiny_diffusion_gemma(tmp_path / "gemma", seed=4))
    one = Engine(EngineConfig(model=path, dtype="float32", max_rows=4))
    config = EngineConfig(
        model=path, dtype="float32", max_rows=4, tensor_parallel_size=2, expert_parallel=True
    )
    two = Engine(config)
    model = two.runner.model
    assert isinstance(model, ParallelGemma)
    graph = two.runner.decode_graph = DecodeGraph(model, on_cpu=True)
    try:
        prompts, params = chat_prompts(one.tokenizer), list(SEEDED_ROWS)
        assert batch_tokens(two, prompts[:1], params[0]) == batch_tokens(
            one, prompts[:1], params[0]
        )
        alone = graph.replays
        assert alone > 0 and isinstance(graph._graphs, GemmaGraphs)
        assert batch_tokens(two, prompts, params) == batch_tokens(one, prompts, params)
        assert graph.replays > alone and graph.captures >= 2
        assert graph._graphs.epoch >= 2  # the batch changed: both ranks dropped the graph
        model.workers.check()  # the worker followed every command
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)
