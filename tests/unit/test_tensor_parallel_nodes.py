"""Tensor parallelism across hosts, played on this one machine with real processes over gloo:
rank 0's engine (tensor_parallel_size 4, tensor_parallel_nodes 2) runs ranks 0-1 and an
independently started node process (`python -m dlm_engine.parallel.node_main`, not a child of
the engine) joins its store and runs ranks 2-3. The tokens equal the single-process engine's;
the node exits by itself once the engine stops; a node that never comes, a node rank that dies
and settings that do not fit are clear errors naming what is wrong.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist

from dlm_engine import Engine, EngineConfig
from dlm_engine.parallel import ParallelLM, TensorParallelError, node_main, start
from dlm_engine.parallel.node import parse_leader
from dlm_lab.testing import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread_per_rank_module")


@pytest.fixture(scope="module")
def llada(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tpn") / "llada", "llada", seed=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(c) for c in task.read_text().split()]
    return found


def rank_of(pid: int) -> int:
    """A worker process's rank, from the spec on its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(json.loads(argv[argv.index(b"dlm_engine.parallel.worker_main") + 1])["rank"])


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


@contextmanager
def node_process(port: int, node: int = 1, wait_s: float = 120) -> Iterator[subprocess.Popen]:
    """A node process of its own (a session leader, not the engine's child); stopped by PID if
    the test leaves it running."""
    cmd = [sys.executable, "-m", "dlm_engine.parallel.node_main"]
    cmd += ["--leader", f"127.0.0.1:{port}", "--node", str(node), "--wait", str(wait_s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stderr.close()


def two_node_config(model: str, port: int) -> EngineConfig:
    return EngineConfig(
        model=model, tensor_parallel_size=4, tensor_parallel_nodes=2, tensor_parallel_port=port
    )


def _tokens(engine: Engine, rows: list[dict]) -> list[list[int]]:
    texts = ("Hello there, what is 2+2?", "Sort: 5 3 9 1", "abc")
    prompts = [engine.encode_prompt(text=t) for t in texts]
    return [o.token_ids for o in engine.generate(prompts, rows)]


def test_tp4_over_two_nodes_equals_one_process_and_the_node_exits_after(llada) -> None:
    rows = [
        {"max_tokens": 16, "steps": 16},
        {"max_tokens": 24, "steps": 12, "cache": "dual", "block_length": 8},
        {"max_tokens": 8, "steps": 8, "cache": "prefix", "block_length": 4},
    ]
    want = _tokens(Engine(EngineConfig(model=llada)), rows)
    port = free_port()
    with node_process(port) as node:  # before the engine: it waits for rank 0's store
        engine = Engine(two_node_config(llada, port))
        model = engine.runner.model
        assert isinstance(model, ParallelLM) and model.world == 4
        try:
            assert model.workers.ranks == [1]  # ranks 2 and 3 run under the node
            remote = children(node.pid)
            assert sorted(rank_of(p) for p in remote) == [2, 3]
            assert all(alive(p) for p in remote)
            assert _tokens(engine, rows) == want
        finally:
            model.close()
        assert all(p.poll() is not None for p in model.workers.procs)
        assert node.wait(timeout=30) == 0, node.stderr.read().decode()
        assert not any(alive(p) for p in remote)


def test_a_node_that_never_comes_is_a_clear_error(llada, monkeypatch) -> None:
    monkeypatch.setattr(start, "TIMEOUT_S", 3.0)
    started = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"tensor-parallel node 1 of 2 \(ranks 2\.\.3\) did not join within 3 s"
    ):
        Engine(two_node_config(llada, free_port()))
    assert time.monotonic() - started < 30
    assert not dist.is_initialized()  # rank 0's own worker stopped, the group left


def test_a_dead_rank_on_the_node_is_named_at_rank_0(llada) -> None:
    port = free_port()
    with node_process(port) as node:
        engine = Engine(two_node_config(llada, port))
        model = engine.runner.model
        try:
            [victim] = [p for p in children(node.pid) if rank_of(p) == 2]
            os.kill(victim, signal.SIGKILL)
            assert node.wait(timeout=30) == 1  # the node reports it, stops rank 3 and exits
            with pytest.raises(
                TensorParallelError,
                match=rf"node 1: tensor-parallel worker rank 2 \(pid {victim}\) exited with "
                "signal SIGKILL",
            ):
                engine.generate([engine.encode_prompt(text="abc")], {"max_tokens": 8, "steps": 8})
        finally:
            model.close()


def test_nodes_must_divide_the_size_and_are_settings_like_the_others() -> None:
    from dlm_triton.backend.settings import resolve_settings
    from dlm_triton.launch import cli

    with pytest.raises(
        ValueError, match="tensor_parallel_nodes 2 must divide tensor_parallel_size 3"
    ):
        EngineConfig(model="x", tensor_parallel_size=3, tensor_parallel_nodes=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_port must be in \[1, 65535\]"):
        EngineConfig(model="x", tensor_parallel_port=70000)
    args = cli.build_parser().parse_args(
        ["serve", "--tensor-parallel-nodes", "2", "--tensor-parallel-port", "29600"]
    )
    assert (args.tensor_parallel_nodes, args.tensor_parallel_port) == (2, 29600)
    params = {"checkpoint": "x", "tensor_parallel_nodes": "2"}
    env = {"DLM_TENSOR_PARALLEL_PORT": "29601"}
    got = resolve_settings(params, environ=env)
    assert (got.tensor_parallel_nodes, got.tensor_parallel_port) == (2, 29601)
    argv = ["--leader", "lws-0.lws:29501", "--node", "1"]
    node = cli.build_parser().parse_args(["tp-node", *argv])
    direct = node_main.build_parser().parse_args(argv)  # the same flags and defaults
    assert vars(node) == {**vars(direct), "command": "tp-node"}


def test_leader_addresses() -> None:
    assert parse_leader("dlm-0.dlm.dlm") == ("dlm-0.dlm.dlm", 29500)
    assert parse_leader("10.0.0.7:29600") == ("10.0.0.7", 29600)
    assert parse_leader("[fd00::2]:29600") == ("fd00::2", 29600)
    assert parse_leader("fd00::2") == ("fd00::2", 29500)
    with pytest.raises(ValueError, match="port must be"):
        parse_leader("host:http")


def test_a_node_with_a_wrong_index_says_so_and_exits(llada) -> None:
    """Rank 0 publishes its spec before waiting for nodes: a node told an index its group
    does not have learns it there and exits, without disturbing rank 0."""
    from dlm_engine.parallel.group import host_store
    from dlm_engine.parallel.workers import LOST_KEY, SPEC_KEY

    store = host_store(4, 30, free_port())
    store.set(SPEC_KEY, '{"world": 4, "nodes": 2, "model": "x", "device": "cpu"}')
    with node_process(store.port, node=2, wait_s=10) as node:
        assert node.wait(timeout=60) == 1
        err = node.stderr.read().decode()
    assert "--node 2: rank 0 runs tensor_parallel_nodes 2, so the other nodes are 1..1" in err
    assert not store.check([LOST_KEY])


def test_a_node_without_a_leader_gives_up_after_its_wait() -> None:
    with node_process(free_port(), wait_s=1) as node:
        assert node.wait(timeout=60) == 1
        err = node.stderr.read().decode()
    assert "error: tensor-parallel node 1: rank 0's store at 127.0.0.1:" in err
    assert "did not answer within 1 s" in err
