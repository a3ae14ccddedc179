"""Which forwards replay CUDA graphs (dlm_engine/cuda_graphs.py `worth_a_graph`): the rule is
pure, so it is proven here on CPU; the GPU runs in benchmarks/gpu_check_algorithms.py prove
that graphed and eager forwards give the same tokens."""

from __future__ import annotations

import pytest

from dlm_engine import EngineConfig
from dlm_engine.cuda_graphs import worth_a_graph


def test_whole_sequence_steps_over_the_limit_run_eagerly() -> None:
    assert worth_a_graph(512, whole_sequences=True, max_tokens=512)
    assert not worth_a_graph(513, whole_sequences=True, max_tokens=512)
    assert not worth_a_graph(10_240, whole_sequences=True, max_tokens=512)


def test_in_block_steps_are_always_graphed() -> None:
    """32 rows of 32-token spans are 1,024 packed tokens: launch-bound, few shapes."""
    assert worth_a_graph(1024, whole_sequences=False, max_tokens=512)
    assert worth_a_graph(100_000, whole_sequences=False, max_tokens=1)


def test_zero_limit_graphs_every_shape() -> None:
    assert worth_a_graph(100_000, whole_sequences=True, max_tokens=0)


def test_the_limit_is_validated() -> None:
    assert EngineConfig(model="x").cuda_graph_max_tokens == 1536
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        EngineConfig(model="x", cuda_graph_max_tokens=-1)
