"""DiffusionGemma under tensor parallel on CPU: 2 real ranks over a gloo process group, each
holding half of every layer's heads, dense MLP and routed experts' intermediate size. TP=2
must give one device's tokens (float32, seeded) for single and batched unlike rows over
several canvases, each rank's encoder caches must hold only its key/value heads, and head
counts the ranks do not divide are refused by name before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm_engine import Engine, EngineConfig
from dlm_engine.models.diffusion_gemma import RowCache
from dlm_engine.parallel.gemma import ParallelGemma
from dlm_engine.parallel.sharding import read_shard
from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

pytestmark = pytest.mark.usefixtures("one_thread_per_rank_module")

# 4 query heads, 2 key/value heads on sliding and on full layers: TP=2 divides every count
SPLITTABLE = {"num_global_key_value_heads": 2}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("gemma_tp") / "gemma"
    return str(make_tiny_diffusion_gemma(out, seed=4, text=SPLITTABLE))


def _prompt(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    chat = [{"role": "user", "content": text}]
    return tok.encode(
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )


def test_a_rank_reads_its_slice_of_gate_and_of_up(gemma) -> None:
    """The stacked experts' gate_up [E, 2I, H] is cut in each half (rank r keeps rows r of the
    gate half and r of the up half), down [E, H, I] on its last dimension; attention by
    heads; router and embeddings whole."""
    path = Path(gemma)
    config = json.loads((path / "config.json").read_text())
    whole = read_shard(path, "diffusion_gemma", config, 0, 1, torch.device("cpu"), torch.float32)
    parts = [
        read_shard(path, "diffusion_gemma", config, r, 2, torch.device("cpu"), torch.float32)
        for r in (0, 1)
    ]
    layer = "model.decoder.layers.0."
    gate_up = whole[layer + "experts.gate_up_proj"]  # [4, 32, 32]: I = 16
    gate, up = gate_up.chunk(2, dim=1)
    for r, part in enumerate(parts):
        mine = part[layer + "experts.gate_up_proj"]
        assert mine.shape == (4, 16, 32)
        assert torch.equal(mine[:, :8], gate[:, 8 * r : 8 * (r + 1)])
        assert torch.equal(mine[:, 8:], up[:, 8 * r : 8 * (r + 1)])
        down = whole[layer + "experts.down_proj"]
        assert torch.equal(part[layer + "experts.down_proj"], down[:, :, 8 * r : 8 * (r + 1)])
        q = whole[layer + "self_attn.q_proj.weight"]
        assert torch.equal(part[layer + "self_attn.q_proj.weight"], q.chunk(2)[r])
        for name in (layer + "router.proj.weight", "model.decoder.embed_tokens.weight"):
            assert torch.equal(part[name], whole[name])


def test_diffusion_gemma_tp2_equals_one_device(gemma) -> None:
    one = Engine(EngineConfig(model=gemma, dtype="float32", max_rows=4))
    two = Engine(EngineConfig(model=gemma, dtype="float32", max_rows=4, tensor_parallel_size=2))
    model = two.runner.model
    try:
        assert isinstance(model, ParallelGemma) and len(model.workers.pids) == 1
        layers = model.local.model.decoder.layers
        whole = one.runner.model.model.decoder.layers
        for mine, full in zip(layers, whole, strict=True):  # half of everything split
            assert mine.self_attn.n_heads * 2 == full.self_attn.n_heads
            assert mine.self_attn.n_kv_heads * 2 == full.self_attn.n_kv_heads
            assert mine.mlp.gate_proj.out_features * 2 == full.mlp.gate_proj.out_features
            assert mine.experts.down_proj.shape[2] * 2 == full.experts.down_proj.shape[2]
            assert mine.experts.gate_up_proj.shape[0] == full.experts.gate_up_proj.shape[0]

        # a forward: rank 0's caches hold its key/value heads; hidden states as one device's
        prompt = _prompt(one, "What is 12 + 7?")
        ids = torch.tensor(prompt)
        mine_cache, full_cache = RowCache(len(layers)), RowCache(len(layers))
        model.encode([(ids, mine_cache)])
        one.runner.model.encode([(ids, full_cache)])
        for i in range(len(layers)):
            assert mine_cache.keys[i].shape[0] * 2 == full_cache.keys[i].shape[0]
            torch.testing.assert_close(
                mine_cache.keys[i], full_cache.keys[i][: full_cache.keys[i].shape[0] // 2]
            )
        canvas = torch.tensor([prompt[:16]])
        a = one.runner.model.decode_hidden(canvas, [None], [full_cache])
        b = model.decode_hidden(canvas, [None], [mine_cache])
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        del mine_cache  # dropped on the worker at the next call

        prompts = [_prompt(one, t) for t in ("hi there", "What is 12 + 7?", "sort 4 2 9")]
        params = [
            {"seed": 1, "max_tokens": 40},
            {"seed": 3, "max_tokens": 20, "steps": 8, "t_max": 0.6},
            {"seed": 6, "max_tokens": 48},
        ]

        def tokens(engine: Engine, ps, pp) -> list[list[int]]:
            return [o.token_ids for o in engine.generate(ps, pp)]

        single = tokens(two, prompts[:1], params[0])
        assert single == tokens(one, prompts[:1], params[0])
        batched = tokens(two, prompts, params)
        assert batched == tokens(one, prompts, params)
        assert max(len(t) for t in batched) > one.runner.model.canvas_length  # several canvases
        # the encoder prefix cache would fill rank 0's caches only, not the workers' mirrors
        assert two.runner.prefix_cache is None and one.runner.prefix_cache is not None
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)


def test_head_counts_the_ranks_do_not_divide_are_refused_by_name(tmp_path) -> None:
    """The published tiny layout has one key/value head on full layers: TP=2 is refused naming
    tensor_parallel_size and the count, before any worker starts; so is TP=4 of two."""
    odd = str(make_tiny_diffusion_gemma(tmp_path / "odd", seed=1))
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size 2 does not divide .*layers\.2\..*key/value heads \(1\)",
    ):
        Engine(EngineConfig(model=odd, dtype="float32", tensor_parallel_size=2))
    even = str(make_tiny_diffusion_gemma(tmp_path / "even", seed=1, text=SPLITTABLE))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide .*heads \(2\)"):
        Engine(EngineConfig(model=even, dtype="float32", tensor_parallel_size=4))


def test_diffusion_gemma_tp2_in_fp8_is_as_close_as_one_device_fp8(gemma) -> None:
    """`quantization=fp8` under tensor parallel: each rank quantizes its own shard (an
    expert's down rows scaled over its slice of the intermediate size, as row-parallel FP8
    layers are), so TP=2 agrees with one device's FP8 within FP8 rounding, not bit for bit:
    its decoder states are no farther from float32 than one device's FP8 ones."""
    from dlm_engine.fp8 import Fp8Experts

    keys = dict(model=gemma, dtype="float32", max_rows=2)
    exact = Engine(EngineConfig(**keys)).runner.model
    one = Engine(EngineConfig(**keys, quantization="fp8"))
    two = Engine(EngineConfig(**keys, quantization="fp8", tensor_parallel_size=2))
    model = two.runner.model
    try:
        experts = model.local.model.decoder.layers[0].experts
        assert isinstance(experts.down_proj, Fp8Experts)
        assert experts.down_proj.weight.shape == (4, 32, 8)  # [E, H, I / 2]
        prompt = _prompt(one, "hi there")
        ids, canvas = torch.tensor(prompt), torch.tensor([prompt[:16]])
        states = []
        for m in (exact, one.runner.model, model):
            cache = RowCache(3)
            m.encode([(ids, cache)])
            states.append(m.decode_hidden(canvas, [None], [cache]))
        ref, fp8_one, fp8_two = states
        err_one = (fp8_one - ref).abs().mean()
        err_two = (fp8_two - ref).abs().mean()
        assert 0 < err_two < 1.5 * err_one
        assert (fp8_two - fp8_one).abs().mean() < err_one
        out = two.generate([prompt], {"seed": 2, "max_tokens": 24})[0]
        assert out.error is None and len(out.token_ids) > 0
    finally:
        model.close()
    assert all(p.poll() is not None for p in model.workers.procs)
