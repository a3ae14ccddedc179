"""DiffusionGemma: our loader, model and sampler against transformers' own implementation.

The oracle is `DiffusionGemmaForBlockDiffusion.generate` on a tiny random checkpoint written
by transformers itself (dlm_lab/testing_diffusion_gemma.py), batch 1, CPU float32, after
`torch.manual_seed(seed)`. Its output pads everything after the first end-of-text id; ours
stops there, so tokens are compared up to and including that id.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dlm_engine.decoding.uniform_diffusion import (
    accepted_mask,
    generate,
    make_rows,
    run_rows,
)
from dlm_engine.loader import load_checkpoint
from dlm_engine.models.diffusion_gemma import DiffusionGemmaModel, by_query_chunks
from dlm_lab.testing_diffusion_gemma import generation_settings, make_tiny_diffusion_gemma

transformers = pytest.importorskip("transformers")

CANVAS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg"), canvas_length=CANVAS)


@pytest.fixture(scope="module")
def reference(ckpt):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt)).eval()


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_checkpoint(ckpt, dtype="float32")


def _prompt(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(chat, add_special_tokens=False)


def _reference_tokens(reference, prompt, seed, max_tokens, **over) -> tuple[list[int], float]:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSamplerConfig,
    )

    kwargs = dict(over)
    if "entropy_bound" in kwargs:
        kwargs["sampler_config"] = EntropyBoundSamplerConfig(kwargs.pop("entropy_bound"))
    torch.manual_seed(seed)
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, **kwargs)
    return out.sequences[0, len(prompt) :].tolist(), float(out.tokens_per_forward[0])


def _upto_stop(tokens: list[int], stops: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


CASES = [
    # (prompt, seed, max_tokens, overrides of the checkpoint's generation_config)
    ("hi there", 0, 16, {}),
    ("hi there", 1, 40, {}),
    ("What is 12 + 7? Answer briefly, please.", 3, 48, {}),  # prompt beyond the window
    ("sort 4 2 9", 5, 64, {"confidence_threshold": 2.5, "stability_threshold": 1}),
    ("sort 4 2 9", 6, 64, {"confidence_threshold": 0.3, "stability_threshold": 0}),  # early
    ("abc", 7, 32, {"confidence_threshold": 0.5, "stability_threshold": 0, "entropy_bound": 1.5}),
    ("abc", 9, 32, {"confidence_threshold": 2.5, "stability_threshold": 2, "entropy_bound": 1.5}),
    ("abc", 8, 32, {"max_denoising_steps": 5, "t_min": 0.1, "t_max": 1.2}),
]


@pytest.mark.parametrize(("text", "seed", "max_tokens", "over"), CASES)
def test_tokens_equal_transformers_generate(reference, loaded, text, seed, max_tokens, over):
    gen = json.loads((loaded.path / "generation_config.json").read_text())
    prompt = _prompt(loaded, text)
    want, _ = _reference_tokens(reference, prompt, seed, max_tokens, **over)
    got = generate(
        loaded.model,
        [prompt],
        [generation_settings(loaded.path, max_tokens, CANVAS, **over)],
        [seed],
        gen["eos_token_id"],
    )[0]
    stops = gen["eos_token_id"]
    assert _upto_stop(got, stops) == _upto_stop(want, stops)
    assert len(want) % CANVAS == 0 and len(got) == len(want)  # same number of canvases


def test_adaptive_stopping_ends_a_canvas_early_as_the_reference(reference, loaded):
    """One canvas stopped by the stable-and-confident rule before the step cap: the same
    tokens and the same number of decoder forwards as the reference."""
    gen = json.loads((loaded.path / "generation_config.json").read_text())
    prompt = _prompt(loaded, "sort 4 2 9")
    over = {"confidence_threshold": 0.3, "stability_threshold": 0}
    want, tokens_per_forward = _reference_tokens(reference, prompt, 5, CANVAS, **over)
    rows = make_rows(
        loaded.model, [prompt], [generation_settings(loaded.path, CANVAS, CANVAS, **over)], [5], []
    )
    got = run_rows(loaded.model, rows)[0]
    assert got == want
    assert rows[0].forwards < gen["max_denoising_steps"]
    assert rows[0].forwards == round(CANVAS / tokens_per_forward)


def test_batched_rows_equal_each_alone(loaded):
    gen = json.loads((loaded.path / "generation_config.json").read_text())
    rows = [
        (_prompt(loaded, "hi there"), 1, generation_settings(loaded.path, 40, CANVAS)),
        (
            _prompt(loaded, "What is 12 + 7? Answer briefly."),
            3,
            generation_settings(loaded.path, 48, CANVAS),
        ),
        (
            _prompt(loaded, "abc"),
            8,
            generation_settings(
                loaded.path, 32, CANVAS, max_denoising_steps=5, confidence_threshold=0.5
            ),
        ),
        (
            _prompt(loaded, "sort 4 2 9"),
            6,
            generation_settings(
                loaded.path, 64, CANVAS, confidence_threshold=0.3, stability_threshold=0
            ),
        ),
    ]
    stops = gen["eos_token_id"]
    alone = [generate(loaded.model, [p], [s], [seed], stops)[0] for p, seed, s in rows]
    together = generate(
        loaded.model, [r[0] for r in rows], [r[2] for r in rows], [r[1] for r in rows], stops
    )
    assert together == alone


def test_loader_reads_the_published_layout(loaded, ckpt):
    assert isinstance(loaded.model, DiffusionGemmaModel)
    assert loaded.family.name == "diffusion_gemma"
    assert loaded.model.canvas_length == CANVAS
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DiffusionGemmaForBlockDiffusion"]
    assert loaded.mask_id == -1  # uniform-state diffusion has no mask token
    assert {1, 6} <= set(loaded.stop_ids)


def test_vision_tower_skipped_with_a_message(ckpt, caplog):
    with caplog.at_level("WARNING"):
        load_checkpoint(ckpt, dtype="float32")
    assert any("vision tower" in r.getMessage() for r in caplog.records)


def test_entropy_bound_acceptance_rule():
    entropy = torch.tensor([[0.05, 0.5, 0.02, 0.04, 2.0]])
    # sorted 0.02, 0.04, 0.05, 0.5, 2.0: cumsum - value = 0, .02, .06, .11, .61
    assert accepted_mask(entropy, 0.1).tolist() == [[True, False, True, True, False]]
    assert accepted_mask(entropy, 0.2).tolist() == [[True, True, True, True, False]]
    assert accepted_mask(entropy, 1e-9).tolist() == [[False, False, True, False, False]]


# ---- served: the engine's step loop ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(ckpt):
    from dlm_engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_rows=4))


def _expected(engine, prompt: list[int], seed: int, max_tokens: int, **over) -> list[int]:
    """Our sampler run alone (proven equal to transformers above), cut as served text is:
    at the first stop id (excluded) and at max_tokens."""
    tokens = generate(
        engine.loaded.model,
        [prompt],
        [generation_settings(engine.loaded.path, max_tokens, CANVAS, **over)],
        [seed],
        sorted(engine.stop_ids),
    )[0][:max_tokens]
    for i, t in enumerate(tokens):
        if t in engine.stop_ids:
            return tokens[:i]
    return tokens


def test_engine_rows_batched_equal_the_sampler_alone(engine):
    reqs = [
        (_prompt(engine.loaded, "hi there"), 1, 40, {}),
        (_prompt(engine.loaded, "What is 12 + 7?"), 3, 20, {}),
        (
            _prompt(engine.loaded, "sort 4 2 9"),
            6,
            64,
            {"confidence_threshold": 0.3, "stability_threshold": 0},
        ),
    ]
    params = []
    for _, seed, max_tokens, over in reqs:
        p = {"seed": seed, "max_tokens": max_tokens}
        if "confidence_threshold" in over:
            p |= {"stop_entropy": over["confidence_threshold"], "stability_threshold": 0}
        params.append(p)
    outs = engine.generate([r[0] for r in reqs], params)
    for (prompt, seed, max_tokens, over), out in zip(reqs, outs, strict=True):
        want = _expected(engine, prompt, seed, max_tokens, **over)
        assert out.token_ids[: len(want)] == want
        assert out.finish_reason in ("stop", "length")
        assert len(out.token_ids) <= max_tokens
        assert out.steps >= 1


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": 0.7}, "temperature"),
        ({"block_length": 8}, "block_length"),
        ({"t_min": 0.9, "t_max": 0.5}, "t_max"),
        ({"algorithm": "low_confidence"}, "algorithm"),
        ({"top_k": 5}, "top_k"),
    ],
)
def test_engine_refuses_keys_that_do_not_apply(engine, params, field):
    from dlm_engine import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        engine.resolve_params(params)
    assert err.value.field == field


def test_other_families_refuse_diffusion_gemma_keys():
    from dlm_engine import InvalidRequestError
    from dlm_engine.sampling_params import SamplingParams, resolve

    with pytest.raises(InvalidRequestError) as err:
        resolve(
            SamplingParams(stop_entropy=0.1),
            family="llada",
            default_algorithm="low_confidence",
            uses_blocks=True,
            max_canvas=64,
            default_max_tokens=16,
        )
    assert err.value.field == "stop_entropy"


def test_logprobs_of_the_canvas_tokens(engine):
    """Each returned token gets its log-probability under the step that ended its canvas;
    the token is that distribution's argmax, so it is also the first alternative. The tokens
    are those of the same request without logprobs."""
    prompt = _prompt(engine.loaded, "hi there")
    keys = {"seed": 1, "max_tokens": 40}
    plain = engine.generate([prompt], keys)[0]
    rid = engine.add_request(None, prompt, keys | {"logprobs": 3})
    outs = [o for o in engine.outputs() if o.request_id == rid]
    out = outs[-1]
    assert out.token_ids == plain.token_ids
    entries = [e for o in outs for e in o.logprobs or []]  # each output brings its new ones
    assert [e["token_id"] for e in entries] == out.token_ids
    for e in entries:
        assert e["logprob"] <= 0.0 and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token_id"] == e["token_id"]
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])
        assert 1 <= e["step"] <= out.steps


def test_rows_of_one_length_attend_together_as_each_alone(loaded, monkeypatch):
    """Rows whose caches hold as many positions attend in one batched call a layer
    (`same_length_rows`): the decoder's hidden states equal those of one call a row, bit for
    bit, in a batch that also holds a row of another length."""
    from dlm_engine.models import diffusion_gemma as dg

    model = loaded.model
    gen = torch.Generator().manual_seed(5)
    lengths = [9, 9, 6, 9]
    caches = [dg.RowCache(len(model._decoder.layers), room=CANVAS) for _ in lengths]
    prompts = [torch.randint(3, model.vocab_size, (n,), generator=gen) for n in lengths]
    model.encode(list(zip(prompts, caches, strict=True)))
    assert dg.same_length_rows(caches) == [[0, 1, 3], [2]]
    canvas = torch.randint(3, model.vocab_size, (len(lengths), CANVAS), generator=gen)
    soft = [None, torch.randn(1, CANVAS, model.arch.hidden_size, generator=gen), None, None]
    together = model.decode_hidden(canvas, soft, caches)
    monkeypatch.setattr(dg, "same_length_rows", lambda cs: [[r] for r in range(len(cs))])
    alone = model.decode_hidden(canvas, soft, caches)
    assert torch.equal(together, alone)


def test_grouped_attention_over_several_rows_equals_each_row():
    """The GPU's grouped-head attention (wide heads, masked spans) folds rows into its
    products' batch: each row's output equals that row alone and plain attention."""
    from dlm_engine.models.diffusion_gemma import _grouped_attention

    gen = torch.Generator().manual_seed(0)
    n, heads, kv, t, s, d = 3, 8, 2, 5, 11, 16
    q = torch.randn(n, heads, t, d, generator=gen)
    k = torch.randn(n, kv, s, d, generator=gen)
    v = torch.randn(n, kv, s, d, generator=gen)
    mask = torch.rand(t, s, generator=gen) > 0.3
    mask[:, 0] = True  # every query sees a key
    for m in (None, mask):
        rows = _grouped_attention(q, k, v, m)
        for r in range(n):
            alone = _grouped_attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], m)
            torch.testing.assert_close(rows[r : r + 1], alone, rtol=1e-6, atol=1e-6)
            plain = torch.nn.functional.scaled_dot_product_attention(
                q[r : r + 1],
                k[r : r + 1].repeat_interleave(heads // kv, 1),
                v[r : r + 1].repeat_interleave(heads // kv, 1),
                attn_mask=m,
                scale=1.0,
            )
            torch.testing.assert_close(rows[r : r + 1], plain, rtol=1e-5, atol=1e-5)


def test_masked_attention_in_query_parts_equals_one_call() -> None:
    """A long masked span attends in parts of queries (the GPU's SDPA expands a boolean mask
    into a [queries, keys] bias): each part with its own mask rows gives what one call does."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 37, 8), torch.randn(2, 4, 50, 8), torch.randn(2, 4, 50, 8)
    pos, kpos = torch.arange(13, 50)[:, None], torch.arange(50)[None, :]
    mask = (kpos <= pos) & (kpos > pos - 9)  # causal after 13 cached keys, window 9
    calls = []

    def attend(qc, mc):
        calls.append(qc.shape[2])
        return F.scaled_dot_product_attention(qc, k, v, attn_mask=mc, scale=1.0)

    whole = attend(q, mask)
    calls.clear()
    torch.testing.assert_close(by_query_chunks(attend, q, mask, 10), whole)
    assert calls == [10, 10, 10, 7]
    calls.clear()
    by_query_chunks(attend, q, None, 10)  # unmasked (the decoder's canvas): one call
    assert calls == [37]
