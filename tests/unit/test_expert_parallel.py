"""Expert parallel on CPU: 2 real ranks over a gloo process group, LLaDA2's routed experts
spread whole over them (4 of 8 each) instead of split inside every expert. EP=2 must give the
tokens of one device (greedy, float32) for single requests and batched unlike rows, a
forward's logits allclose, and each rank must hold and read only its own experts.
"""

from __future__ import annotations

import pytest
import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.models.common import full_logits
from dlm_engine.models.moe import route, run_experts
from dlm_engine.parallel import ParallelLM
from dlm_engine.parallel.sharding import read_shard
from dlm_lab.testing import make_tiny_checkpoint
from dlm_lab.testing_diffusion_gemma import (
    SEEDED_ROWS,
    batch_tokens,
    chat_prompts,
    make_tiny_diffusion_gemma,
)

pytestmark = pytest.mark.usefixtures("one_thread_per_rank_module")


def test_each_ranks_experts_sum_to_all_experts() -> None:
    """`run_experts` over experts [first, first + E/N) of each rank adds up to every expert:
    pairs routed elsewhere add nothing (not even the garbage rows past the last group)."""
    g = torch.Generator().manual_seed(0)
    n, h, inter, experts = 37, 16, 8, 8
    x = torch.randn(n, h, generator=g)
    gate = torch.randn(experts, h, generator=g)
    chosen, weights = route(
        x, gate, torch.zeros(experts), top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    w_gate_up = torch.randn(experts, h, 2 * inter, generator=g)
    w_down = torch.randn(experts, inter, h, generator=g)
    whole = run_experts(x, chosen, weights, w_gate_up, w_down)
    for world in (2, 4):
        per = experts // world
        parts = [
            run_experts(
                x,
                chosen,
                weights,
                w_gate_up[r * per : (r + 1) * per],
                w_down[r * per : (r + 1) * per],
                first_expert=r * per,
            )  # fmt: skip
            for r in range(world)
        ]
        assert all(torch.isfinite(p).all() for p in parts)
        torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
    # a rank none of whose experts is chosen adds exactly zero
    none = run_experts(x, chosen.clamp(max=3), weights, w_gate_up[4:], w_down[4:], first_expert=4)
    assert torch.equal(none, torch.zeros_like(none))


@pytest.fixture(scope="module")
def llada2(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("ep") / "llada2", "llada2", seed=3))


def test_a_rank_reads_only_its_own_experts(llada2) -> None:
    import json
    from pathlib import Path

    config = json.loads((Path(llada2) / "config.json").read_text())
    whole = read_shard(Path(llada2), "llada2", config, 0, 1, torch.device("cpu"), torch.float32)
    for rank in (0, 1):
        part = read_shard(
            Path(llada2), "llada2", config, rank, 2, torch.device("cpu"), torch.float32, True
        )
        experts = {n for n in part if ".mlp.experts." in n}
        # layer 0 is dense; layers 1 and 2 hold experts 0-3 of their 8, 3 tensors each
        assert len(experts) == 2 * 4 * 3
        for layer in (1, 2):
            for local in range(4):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    mine = f"model.layers.{layer}.mlp.experts.{local}.{proj}.weight"
                    model = f"model.layers.{layer}.mlp.experts.{rank * 4 + local}.{proj}.weight"
                    assert torch.equal(part[mine], whole[model])  # whole, renumbered
        # the shared expert stays split inside (half of its intermediate size each)
        shared = "model.layers.1.mlp.shared_experts.gate_proj.weight"
        assert part[shared].shape[0] * 2 == whole[shared].shape[0]


def test_llada2_ep2_equals_one_device(llada2) -> None:
    one = Engine(EngineConfig(model=llada2))
    two = Engine(EngineConfig(model=llada2, tensor_parallel_size=2, expert_parallel=True))
    model = two.runner.model
    try:
        assert isinstance(model, ParallelLM) and len(model.workers.pids) == 1
        moe = model.local.model.layers[1].mlp
        assert moe.first_expert == 0 and moe.w_gate_up.shape[0] == 4  # 4 of 8 experts, whole
        assert moe.w_gate_up.shape[1:] == one.runner.model.model.layers[1].mlp.w_gate_up.shape[1:]
        texts = ("Hello there, what is 2+2?", "Sort: 5 3 9 1", "abc")
        prompts = [one.encode_prompt(text=t) for t in texts]
        x = torch.tensor([prompts[0] + [one.mask_id] * 12])
        a, b = full_logits(one.runner.model)(x), full_logits(model)(x)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        rows = [{"max_tokens": 16}, {"max_tokens": 40}, {"max_tokens": 20}]

        def tokens(engine: Engine, ps, params) -> list[list[int]]:
            return [o.token_ids for o in engine.generate(ps, params)]

        assert tokens(two, prompts[:1], rows[0]) == tokens(one, prompts[:1], rows[0])
        assert tokens(two, prompts, rows) == tokens(one, prompts, rows)
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)  # every worker reaped


def test_expert_parallel_is_refused_by_name_where_it_cannot_run(tmp_path) -> None:
    llada = str(make_tiny_checkpoint(tmp_path / "llada", "llada", seed=1))
    with pytest.raises(ValueError, match="expert_parallel is not supported for the llada family"):
        Engine(EngineConfig(model=llada, tensor_parallel_size=2, expert_parallel=True))
    odd = str(
        make_tiny_checkpoint(
            tmp_path / "odd", "llada2", seed=1, num_experts=3, n_group=1, topk_group=1
        )
    )
    with pytest.raises(ValueError, match=r"does not divide .*num_experts.*expert_parallel \(3\)"):
        Engine(EngineConfig(model=odd, tensor_parallel_size=2, expert_parallel=True))


def test_expert_parallel_is_a_flag_an_env_var_and_a_parameter() -> None:
    from dlm_triton.backend.settings import resolve_settings
    from dlm_triton.launch import cli

    args = cli.build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "2", "--expert-parallel"]
    )
    assert args.expert_parallel is True
    assert cli.build_parser().parse_args(["serve"]).expert_parallel is None  # not set: default
    params = {"checkpoint": "x", "expert_parallel": "true"}
    assert resolve_settings(params, environ={}).expert_parallel is True
    env = {"DLM_EXPERT_PARALLEL": "1"}
    assert resolve_settings({"checkpoint": "x"}, environ=env).expert_parallel is True
    assert resolve_settings({"checkpoint": "x"}, environ={}).expert_parallel is False
    with pytest.raises(ValueError, match="expert_parallel must be true or false"):
        resolve_settings({"checkpoint": "x", "expert_parallel": "maybe"}, environ={})
    assert EngineConfig(model="x").expert_parallel is False


def test_diffusion_gemma_ep2_equals_one_device(tmp_path) -> None:
    """DiffusionGemma under expert parallel: each rank holds 2 of the
    4 experts of every layer (sliced from the stacked tensors), attention and dense MLPs
    replicated, the workers mirror each row's encoder cache; batched rows with their seeds
    give one device's tokens, and a cache dropped on rank 0 is dropped on the workers."""
    from dlm_engine.parallel.gemma import LocalExperts, ParallelGemma

    path = str(make_tiny_diffusion_gemma(tmp_path / "gemma", seed=4))
    one = Engine(EngineConfig(model=path, dtype="float32", max_rows=4))
    # split by tensor parallel instead, its full layers' one key/value head would not divide
    with pytest.raises(ValueError, match=r"does not divide .*key/value heads \(1\)"):
        Engine(EngineConfig(model=path, tensor_parallel_size=2))
    two = Engine(
        EngineConfig(
            model=path, dtype="float32", max_rows=4, tensor_parallel_size=2, expert_parallel=True
        )
    )
    model = two.runner.model
    try:
        assert isinstance(model, ParallelGemma) and len(model.workers.pids) == 1
        experts = model.local.model.decoder.layers[0].experts
        whole = one.runner.model.model.decoder.layers[0].experts
        assert isinstance(experts, LocalExperts) and experts.first == 0
        assert experts.gate_up_proj.shape[0] * 2 == whole.gate_up_proj.shape[0]
        assert torch.equal(experts.gate_up_proj, whole.gate_up_proj[:2])
        prompts, params = chat_prompts(one.tokenizer), list(SEEDED_ROWS)
        assert batch_tokens(two, prompts[:1], params[0]) == batch_tokens(
            one, prompts[:1], params[0]
        )
        assert batch_tokens(two, prompts, params) == batch_tokens(one, prompts, params)
        assert model.ids.next >= 4  # a cache a row, each numbered once
        # the encoder prefix cache would fill rank 0's caches only, not the workers' mirrors
        assert two.runner.prefix_cache is None and one.runner.prefix_cache is not None
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)


def test_diffusion_gemma_ep2_in_fp8_equals_one_device(tmp_path) -> None:
    """`quantization=fp8` under expert parallel: each rank quantizes its own experts (one
    scale per expert's output channel, as the whole stack quantizes them), so the tokens equal
    one device's FP8 engine."""
    from dlm_engine.fp8 import Fp8Experts

    path = str(make_tiny_diffusion_gemma(tmp_path / "gemma", seed=4))
    keys = dict(model=path, dtype="float32", max_rows=2, quantization="fp8")
    one = Engine(EngineConfig(**keys))
    two = Engine(EngineConfig(**keys, tensor_parallel_size=2, expert_parallel=True))
    model = two.runner.model
    try:
        experts = model.local.model.decoder.layers[0].experts
        assert isinstance(experts.gate_up_proj, Fp8Experts)
        prompt = one.tokenizer.encode("hi there", add_special_tokens=False)
        params = {"seed": 2, "max_tokens": 32}
        assert two.generate([prompt], params)[0].token_ids == (
            one.generate([prompt], params)[0].token_ids
        )
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)


def test_diffusion_gemma_ep2_names_a_dead_rank_as_its_fault(tmp_path) -> None:
    """A killed expert-parallel worker is the engine's fault at once (a server polls it and
    restarts the model), before any forward fails."""
    import os
    import signal

    path = str(make_tiny_diffusion_gemma(tmp_path / "gemma", seed=4))
    keys = dict(model=path, dtype="float32", max_rows=2, tensor_parallel_size=2)
    engine = Engine(EngineConfig(**keys, expert_parallel=True))
    model = engine.runner.model
    try:
        assert engine.fault() is None
        (pid,) = model.workers.pids
        os.kill(pid, signal.SIGKILL)
        model.workers.procs[0].wait(timeout=10)
        assert f"rank 1 (pid {pid}) exited with signal SIGKILL" in engine.fault()
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)
