"""Fast-dLLM v2: detected from its published config and built in its published layout, the
sub-block commit span, and the engine's tokens equal to its published `generate()`
(dlm_lab/reference_fast_dllm_v2.py) at temperature 0, alone and batched with unlike rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from block_checks import check_alone_and_batched

from dlm_engine import Engine, EngineConfig
from dlm_engine.decoding.sub_blocks import commit_span
from dlm_engine.models import DREAM, FAST_DLLM_V2, build_model, detect_family
from dlm_lab import testing
from dlm_lab.reference_fast_dllm_v2 import fast_dllm_v2_generate

# Efficient-Large-Model/Fast_dLLM_v2_7B config.json: Qwen2.5-7B-Instruct's keys plus bd_size
PUBLISHED_7B = {
    "architectures": ["Fast_dLLM_QwenForCausalLM"],
    "model_type": "Fast_dLLM_Qwen",
    "bd_size": 32,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
# prompt lengths 3, 11 and 16 (= one block: the first decoded block starts with the argmax of
# the prompt's last position), unlike lengths, thresholds and stops in one batch
TEXTS = ["abc", "Hello there", "x" * 16]
CASES = [
    {"max_tokens": 40},  # the family's threshold 0.9
    {"max_tokens": 21, "threshold": 0.3},
    {"max_tokens": 18, "threshold": 1.0},  # generate()'s default: one token a step
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("fast_dllm_v2") / "m"
    return str(testing.make_tiny_checkpoint(path, "fast_dllm_v2", seed=3, bd_size=16))


@pytest.fixture(scope="module")
def engine(ckpt: str) -> Engine:
    return Engine(EngineConfig(model=ckpt, device="cpu"))


def test_published_config_is_fast_dllm_v2_and_builds_7b() -> None:
    assert detect_family(PUBLISHED_7B) is FAST_DLLM_V2
    assert detect_family({"model_type": "Dream", "architectures": ["DreamModel"]}) is DREAM
    with torch.device("meta"):
        model = build_model(FAST_DLLM_V2, PUBLISHED_7B)
    assert model.block_size == 32 and model.logits_shift == 1
    total = sum(p.numel() for p in model.parameters())
    assert 7.5e9 < total < 7.7e9  # 7.6B, as Qwen2.5-7B
    names = dict(model.named_parameters())
    for n in ("model.layers.27.self_attn.q_proj.bias", "model.layers.0.mlp.up_proj.weight"):
        assert n in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    with pytest.raises(ValueError, match="use_sliding_window"):
        build_model(FAST_DLLM_V2, {**PUBLISHED_7B, "use_sliding_window": True})


def test_tiny_checkpoint_has_the_published_layout(ckpt: str, engine: Engine) -> None:
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    assert cfg["model_type"] == "Fast_dLLM_Qwen" and cfg["bd_size"] == 16
    assert "mask_token_id" not in cfg  # the tokenizer names it, as published
    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.self_attn.k_proj.bias" in index and "lm_head.weight" in index
    assert engine.loaded.family is FAST_DLLM_V2 and engine.model_block == 16
    assert engine.mask_token == "|<MASK>|"


@pytest.mark.parametrize(
    ("canvas", "prompt_len", "block_start", "expected"),
    [
        ([9, 0, 0, 0, 0, 0, 0, 0], 8, 8, (0, 4)),  # first token given: its sub-block
        ([0] * 8, 8, 8, (0, 1)),  # a new block's first token alone
        ([0] * 6, 2, 0, (0, 2)),  # prompt tail [0, 2): the rest of sub-block 0
        ([5, 5, 0, 0, 0, 0], 2, 0, (2, 6)),  # sub-block 0 full: sub-block 1
        ([5, 5, 5, 5, 5, 5], 2, 0, None),  # no mask left
    ],
)
def test_commit_span(canvas, prompt_len, block_start, expected) -> None:
    window_start = max(prompt_len, block_start)
    span = commit_span(
        canvas,
        prompt_len=prompt_len,
        block_start=block_start,
        window_start=window_start,
        block=8,
        sub=4,
        mask_id=0,
    )
    assert span == expected


def test_reference_decodes_sub_blocks_in_order(engine: Engine) -> None:
    """threshold 1: one commit a step; every block's tokens after the first come in sub-block
    order, and the block after a full one starts with its last position's argmax."""
    prompt = engine.encode_prompt(text="Hello there")
    run = fast_dllm_v2_generate(
        engine.loaded.model,
        prompt,
        mask_id=engine.mask_id,
        stop_token=-1,
        max_new_tokens=48,
        block_size=16,
        small_block_size=8,
        threshold=1.0,
    )
    assert all(c == 1 for counts in run.commits for c in counts)
    # 16 - 11 masks of the first block, then 15 of each (their first token came before)
    assert [len(c) for c in run.commits] == [5, 15, 15]
    assert len(run.tokens) == 5 + 1 + 15 + 1 + 15 + 1


def test_engine_equals_published_generate_alone_and_batched(engine: Engine) -> None:
    prompts = [engine.encode_prompt(text=t) for t in TEXTS]
    pairs = [(p, c) for c in CASES for p in prompts]
    check_alone_and_batched(engine, pairs, testing.block_reference, past=16)


def test_engine_equals_published_generate_with_early_stops(tmp_path: Path) -> None:
    ckpt = testing.make_tiny_checkpoint(
        tmp_path / "m", "fast_dllm_v2", seed=5, bd_size=16, eos_boost=1.2
    )
    engine = Engine(EngineConfig(model=str(ckpt), device="cpu"))
    prompts = [engine.encode_prompt(text=t) for t in TEXTS]
    pairs = [(p, {"max_tokens": 40, "threshold": 0.5}) for p in prompts]
    expected = check_alone_and_batched(engine, pairs, testing.block_reference, past=0)
    assert any(len(e) < 40 for e in expected), "some answer must stop early"


def test_two_ranks_equal_one_device(ckpt: str) -> None:
    """Tensor parallel on 2 CPU ranks (Qwen's sharding): the same tokens as one device."""
    from dlm_engine.parallel import ParallelLM

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    one = Engine(EngineConfig(model=ckpt))
    two = Engine(EngineConfig(model=ckpt, tensor_parallel_size=2))
    model = two.runner.model
    try:
        assert isinstance(model, ParallelLM) and len(model.workers.pids) == 1
        prompts = [one.encode_prompt(text=t) for t in TEXTS]

        def tokens(engine: Engine, ps, params) -> list[list[int]]:
            return [o.token_ids for o in engine.generate(ps, params)]

        assert tokens(two, prompts[:1], CASES[0]) == tokens(one, prompts[:1], CASES[0])
        assert tokens(two, prompts, CASES) == tokens(one, prompts, CASES)
    finally:
        model.close()
        torch.set_num_threads(before)
    assert all(p.poll() is not None for p in model.workers.procs)  # every worker reaped


def test_bucketed_shapes_give_the_same_tokens(ckpt: str) -> None:
    """The CUDA-graph path's padded shapes (rows, query width, pages) on CPU: the shifted
    logits index and the sub-block spans still read the right positions."""
    engine = Engine(EngineConfig(model=ckpt, device="cpu"))
    graphs = testing.EagerGraphs()
    engine.runner.graphs, engine.runner.length_multiple = graphs, 32
    prompts = [engine.encode_prompt(text=t) for t in TEXTS]
    expected = [testing.block_reference(engine, p, CASES[1]) for p in prompts]
    assert [o.token_ids for o in engine.generate(prompts, CASES[1])] == expected
    assert graphs.shapes, "the padded path ran"


def test_prefix_cache_keeps_the_position_before_the_first_decoded_one(ckpt: str) -> None:
    """A prompt ending on a block boundary: its first decoded token is read from the prompt's
    last position, so a repeat shares all prompt pages but the last block's."""
    engine = Engine(EngineConfig(model=ckpt, device="cpu"))
    prompt = engine.encode_prompt(text="y" * 32)
    assert len(prompt) == 32
    case = {"max_tokens": 20, "threshold": 0.3}
    expected = testing.block_reference(engine, prompt, case)
    assert engine.generate([prompt], case)[0].token_ids == expected
    hits = engine.runner.prefix_cache.hit_tokens
    assert engine.generate([prompt], case)[0].token_ids == expected
    assert engine.runner.prefix_cache.hit_tokens - hits == 16


def test_logit_bias_bans_and_forces_tokens(engine: Engine) -> None:
    """OpenAI's `logit_bias` on Fast-dLLM v2's sub-block rows: -100 keeps a token out of the
    answer, +100 puts it at every position."""
    prompt = engine.encode_prompt(messages=[{"role": "user", "content": "Sort: 5 3 9 1"}])
    keys = {"max_tokens": 16}
    plain = engine.generate([prompt], keys)[0].token_ids
    banned = plain[0]
    out = engine.generate([prompt], dict(keys, logit_bias={str(banned): -100}))[0].token_ids
    assert banned not in out
    (forced,) = engine.tokenizer.encode("q", add_special_tokens=False)
    out = engine.generate([prompt], dict(keys, logit_bias={forced: 100}))[0].token_ids
    assert out == [forced] * 16
