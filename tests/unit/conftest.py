"""Tiny random checkpoints of both families, built once per test session; one torch thread
per rank for the tests that start several ranks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dlm_engine import Engine, EngineConfig
from dlm_lab.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "llada": make_tiny_checkpoint(root / "llada", "llada", seed=1),
        "dream": make_tiny_checkpoint(root / "dream", "dream", seed=1),
        "llada_eos": make_tiny_checkpoint(root / "llada_eos", "llada", seed=1, eos_boost=0.35),
        "dream_eos": make_tiny_checkpoint(root / "dream_eos", "dream", seed=1, eos_boost=1.0),
    }


@pytest.fixture(scope="session")
def engines(ckpt_dir: dict[str, Path]) -> dict[str, Engine]:
    return {
        name: Engine(EngineConfig(model=str(path), max_rows=8)) for name, path in ckpt_dir.items()
    }


def _one_thread() -> Iterator[None]:
    """Several ranks on a 2-core machine: one thread each (workers take rank 0's count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


one_thread_per_rank = pytest.fixture(_one_thread, name="one_thread_per_rank")
# for modules whose every test starts ranks: `pytestmark = usefixtures(...)`
one_thread_per_rank_module = pytest.fixture(
    _one_thread, scope="module", name="one_thread_per_rank_module"
)
