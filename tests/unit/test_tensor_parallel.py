"""Tensor parallelism on CPU: 2 real ranks (rank 0 here, rank 1 a worker process) over a gloo
process group. TP=2 must give the tokens of TP=1 (greedy, float32) for single requests and
batched unlike rows, in every mode (exact, Fast-dLLM cached, block diffusion, LLaDA2's
experts), and one forward's logits allclose (a rank's all-reduce sums in another order than
one matmul). A killed worker is a clear error at rank 0's next forward, and no worker
outlives its engine.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dlm_engine import Engine, EngineConfig, EngineLoop
from dlm_engine.models.common import ForwardBatch, full_logits
from dlm_engine.parallel import ParallelLM, TensorParallelError
from dlm_lab.testing import make_tiny_checkpoint
from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

pytestmark = pytest.mark.usefixtures("one_thread_per_rank_module")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {
        fam: str(make_tiny_checkpoint(root / fam, fam, seed=1))
        for fam in ("llada", "dream", "sdar", "llada2")
    }


@contextmanager
def tp_engine(path: str, world: int = 2) -> Iterator[Engine]:
    engine = Engine(EngineConfig(model=path, tensor_parallel_size=world))
    model = engine.runner.model
    assert isinstance(model, ParallelLM) and len(model.workers.pids) == world - 1
    try:
        yield engine
    finally:
        model.close()
        # every worker reaped: none left running
        assert all(p.poll() is not None for p in model.workers.procs)


def _prompts(engine: Engine) -> list[list[int]]:
    texts = ("Hello there, what is 2+2?", "Sort: 5 3 9 1", "abc")
    return [engine.encode_prompt(text=t) for t in texts]


def _tokens(engine: Engine, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


def _same_logits(one: Engine, two: Engine, prompt: list[int]) -> None:
    x = torch.tensor([prompt + [one.mask_id] * 12])
    a = full_logits(one.runner.model)(x)
    b = full_logits(two.runner.model)(x)
    assert a.shape == b.shape
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def _check_family(path: str, rows: list[dict]) -> None:
    one = Engine(EngineConfig(model=path))
    with tp_engine(path) as two:
        prompts = _prompts(one)
        # rank 0 holds half of every split weight, not a copy of the model
        whole = sum(p.numel() for p in one.runner.model.parameters())
        shard = sum(p.numel() for p in two.runner.model.parameters())
        assert shard < 0.8 * whole
        _same_logits(one, two, prompts[0])
        single = {k: v for k, v in rows[0].items()}
        assert _tokens(two, prompts[:1], single) == _tokens(one, prompts[:1], single)
        assert _tokens(two, prompts, rows) == _tokens(one, prompts, rows)


def test_llada_tp2_equals_tp1(ckpts) -> None:
    _check_family(
        ckpts["llada"],
        [
            {"max_tokens": 16, "steps": 16},
            {"max_tokens": 24, "steps": 12, "cache": "dual", "block_length": 8},
            {"max_tokens": 8, "steps": 8, "cache": "prefix", "block_length": 4},
        ],
    )


def test_dream_tp2_equals_tp1(ckpts) -> None:
    _check_family(
        ckpts["dream"],
        [
            {"max_tokens": 16, "steps": 16},
            {"max_tokens": 24, "steps": 12},
            {"max_tokens": 12, "steps": 12, "cache": "dual", "block_length": 4},
        ],
    )


def test_sdar_block_diffusion_tp2_equals_tp1(ckpts) -> None:
    _check_family(ckpts["sdar"], [{"max_tokens": 16}, {"max_tokens": 12}, {"max_tokens": 20}])


def test_llada2_moe_tp2_equals_tp1(ckpts) -> None:
    """Attention heads split from the published fused q/k/v, every expert's intermediate
    size split (one all-reduce per MoE layer), routing replicated; block diffusion pages."""
    _check_family(ckpts["llada2"], [{"max_tokens": 16}, {"max_tokens": 40}, {"max_tokens": 20}])


def test_killed_worker_is_a_clear_error(ckpts) -> None:
    """A killed rank is a fault of the engine at once (a server polls it and reports the
    model dead), and the next forward's error names it."""
    with tp_engine(ckpts["dream"]) as engine:
        assert engine.fault() is None
        pid = engine.runner.model.workers.pids[0]
        os.kill(pid, signal.SIGKILL)
        engine.runner.model.workers.procs[0].wait(timeout=10)
        assert f"rank 1 (pid {pid}) exited with signal SIGKILL" in engine.fault()
        started = time.monotonic()
        with pytest.raises(
            TensorParallelError, match=rf"rank 1 \(pid {pid}\) exited with signal SIGKILL"
        ):
            engine.generate(_prompts(engine)[:1], {"max_tokens": 8, "steps": 8})
        assert time.monotonic() - started < 10  # an error, not a hang


def test_a_failed_forward_refuses_the_next_instead_of_pairing_wrong_collectives(
    ckpts, monkeypatch
) -> None:
    """Rank 0 fails after the workers started a forward (they wait in its collectives): the
    next forward is refused by name, never run out of step; stopping still reaps them."""
    with tp_engine(ckpts["dream"]) as engine:
        model = engine.runner.model

        def fails(batch):
            raise RuntimeError("out of memory (simulated)")

        monkeypatch.setattr(model.local, "hidden_states", fails)
        prompt = _prompts(engine)[:1]
        with pytest.raises(TensorParallelError, match="simulated"):
            engine.generate(prompt, {"max_tokens": 8, "steps": 8})
        monkeypatch.undo()
        ids = torch.tensor(prompt)
        batch = ForwardBatch(ids, torch.arange(ids.shape[1])[None], None, None)
        with pytest.raises(TensorParallelError, match="an earlier tensor-parallel forward failed"):
            model.hidden_states(batch)
        assert "simulated" in engine.fault() and "out of step" in engine.fault()


def test_served_loop_fails_rows_on_a_dead_worker_and_stops_the_rest(ckpts) -> None:
    """Behind `EngineLoop` (how servers run the engine): a dead worker fails the running
    request with the error naming it, the loop lives on, and its shutdown reaps the workers."""
    with tp_engine(ckpts["llada"]) as engine:
        loop = EngineLoop(engine, torch_threads=1)
        finals: queue.Queue = queue.Queue()
        prompt = _prompts(engine)[0]

        def final(rid: str):
            params = engine.resolve_params({"max_tokens": 8, "steps": 8})
            loop.submit(rid, prompt, params, lambda o: finals.put(o) if o.finished else None)
            return finals.get(timeout=60)

        ok = final("a")
        assert ok.error is None and len(ok.token_ids) > 0
        worker = engine.runner.model.workers.procs[0]
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        failed = final("b")
        assert f"worker rank 1 (pid {worker.pid}) exited with signal SIGKILL" in failed.error
        loop.shutdown()
        assert engine.runner.model.workers.stopped


def test_unsupported_settings_are_refused_by_name(tmp_path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="x", tensor_parallel_size=0)
    gemma = str(make_tiny_diffusion_gemma(tmp_path / "gemma"))
    # its full layers' one key/value head: two ranks cannot split it
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide .*heads \(1\)"):
        Engine(EngineConfig(model=gemma, tensor_parallel_size=2))
    llada = str(make_tiny_checkpoint(tmp_path / "llada", "llada", seed=1))
    with pytest.raises(ValueError, match="quantization=int8 .* tensor_parallel_size 2"):
        Engine(EngineConfig(model=llada, tensor_parallel_size=2, quantization="int8"))
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide .*heads"):
        Engine(EngineConfig(model=llada, tensor_parallel_size=3))  # 4 heads
    assert not _any_worker_for(llada)


def _any_worker_for(checkpoint: str) -> bool:
    """A live worker rank process loading `checkpoint` (none may start for a refused one)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes()
        except OSError:
            continue
        if b"dlm_engine.parallel.worker_main" in cmd and checkpoint.encode() in cmd:
            return True
    return False


def test_a_worker_that_dies_at_start_is_reported_at_once(ckpts, monkeypatch) -> None:
    """A worker that exits before joining the group (here: an interpreter that fails) is an
    error naming it within seconds, not rank 0 waiting out the group's timeout."""
    from dlm_engine.parallel import workers

    monkeypatch.setattr(workers, "_python", lambda: "/bin/false")
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with exit status 1"):
        Engine(EngineConfig(model=ckpts["dream"], tensor_parallel_size=2))
    assert time.monotonic() - started < 30
    assert not dist.is_initialized()  # a later engine may start its own group


def test_tensor_parallel_size_is_a_flag_an_env_var_and_a_parameter() -> None:
    from dlm_triton.backend.settings import resolve_settings
    from dlm_triton.launch import cli

    args = cli.build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
    params = {"checkpoint": "x", "tensor_parallel_size": "2"}
    assert resolve_settings(params, environ={}).tensor_parallel_size == 2
    env = {"DLM_TENSOR_PARALLEL_SIZE": "4"}
    assert resolve_settings(params, environ=env).tensor_parallel_size == 4
    assert not resolve_settings({"checkpoint": "x"}, environ={}).configured("tensor_parallel_size")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer"):
        resolve_settings({"checkpoint": "x", "tensor_parallel_size": "two"}, environ={})
