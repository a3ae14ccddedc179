"""OpenAI's `logit_bias` on DiffusionGemma rows (decoding/uniform_diffusion.py, logit_bias.py).

The bias is added to each step's logits before the temperature schedule reads them, which is
what a `logits_processor` given to transformers' `generate` does: so the oracle stays
transformers itself. Served rows: a -100 token never appears, a +100 token fills the answer,
a biased row batched with others equals itself alone, and logprobs stay the model's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm_engine.decoding.uniform_diffusion import UniformRow, run_rows
from dlm_engine.loader import load_checkpoint
from dlm_lab.testing_diffusion_gemma import generation_settings, make_tiny_diffusion_gemma

pytest.importorskip("transformers")

CANVAS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg"), canvas_length=CANVAS)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_checkpoint(ckpt, dtype="float32")


@pytest.fixture(scope="module")
def engine(ckpt):
    from dlm_engine import Engine, EngineConfig

    return Engine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_rows=8))


def _prompt(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(chat, add_special_tokens=False)


def _letter(tok, text: str) -> int:
    (token,) = tok.encode(text, add_special_tokens=False)
    return token


class _AddBias:
    """transformers' side: a logits processor adding the same biases to every position."""

    def __init__(self, biases: dict[int, float]) -> None:
        self.biases = biases

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros(scores.shape[-1], dtype=scores.dtype)
        for token, value in self.biases.items():
            bias[token] = value
        return scores + bias


def _ours(loaded, prompt, seed, max_tokens, biases) -> list[int]:
    gen = json.loads((loaded.path / "generation_config.json").read_text())
    settings = generation_settings(loaded.path, max_tokens, CANVAS)
    model = loaded.model
    row = UniformRow(
        torch.tensor(prompt),
        settings,
        seed=seed,
        n_layers=len(model.model.decoder.layers),
        canvas_length=CANVAS,
        vocab_size=model.vocab_size,
        stop_ids=torch.tensor(gen["eos_token_id"]),
        logit_bias=tuple(sorted(biases.items())),
    )
    return run_rows(model, [row])[0]


def _upto_stop(tokens: list[int], stops: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("seed", [0, 3])
def test_biased_sampler_equals_transformers_with_a_bias_processor(ckpt, loaded, seed):
    """Every step, renoise and stop with the bias equals transformers' `generate` given a
    logits processor that adds the same bias: a ban of the unbiased answer's first token, a
    push towards another, a small nudge."""
    from transformers import DiffusionGemmaForBlockDiffusion, LogitsProcessorList

    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt)).eval()
    tok = loaded.tokenizer
    gen = json.loads((loaded.path / "generation_config.json").read_text())
    prompt = _prompt(tok, "hi there")
    plain = _ours(loaded, prompt, seed, 32, {})
    biases = {plain[0]: -100.0, _letter(tok, "e"): 6.0, _letter(tok, "o"): 1.5}
    torch.manual_seed(seed)
    out = reference.generate(
        torch.tensor([prompt]),
        max_new_tokens=32,
        logits_processor=LogitsProcessorList([_AddBias(biases)]),
    )
    want = out.sequences[0, len(prompt) :].tolist()
    got = _ours(loaded, prompt, seed, 32, biases)
    stops = gen["eos_token_id"]
    assert _upto_stop(got, stops) == _upto_stop(want, stops)
    assert got != plain  # the bias changed the answer
    assert plain[0] not in _upto_stop(got, stops)


def test_a_banned_token_never_appears_and_a_forced_one_fills_the_answer(engine):
    tok = engine.tokenizer
    prompt = _prompt(tok, "hi there")
    keys = {"max_tokens": 40}
    for seed in (0, 1, 2):
        plain = engine.generate([prompt], keys | {"seed": seed})[0].token_ids
        banned = sorted(set(plain))[:3]  # the answer's own tokens
        out = engine.generate(
            [prompt], keys | {"seed": seed, "logit_bias": {str(t): -100 for t in banned}}
        )[0]
        assert out.error is None and out.token_ids
        assert not set(out.token_ids) & set(banned)
    q = _letter(tok, "q")
    forced = engine.generate([prompt], keys | {"seed": 4, "logit_bias": {str(q): 100}})[0]
    assert forced.token_ids == [q] * 40 and forced.finish_reason == "length"


def test_a_biased_row_batched_equals_itself_alone(engine):
    tok = engine.tokenizer
    prompts = [_prompt(tok, t) for t in ("hi there", "sort 4 2 9", "abc")]
    params = [
        {"seed": 1, "max_tokens": 40, "logit_bias": {str(_letter(tok, "a")): 8}},
        {"seed": 2, "max_tokens": 24},
        {"seed": 3, "max_tokens": 32, "logit_bias": {str(_letter(tok, " ")): -100, "1": 3}},
    ]
    together = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        alone = engine.generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids
    assert together[0].token_ids != engine.generate([prompts[0]], params[1] | {"seed": 1})[0]


def test_logprobs_stay_the_model_distribution(engine):
    """A +100 token is all but certain under the biased logits (logprob 0, the top choice at
    every position); its logprobs are the model's own: well below 0, and at some positions
    the model itself prefers another token."""
    tok = engine.tokenizer
    q = _letter(tok, "q")
    prompt = _prompt(tok, "hi there")
    rid = engine.add_request(
        None, prompt, {"seed": 5, "max_tokens": 16, "logit_bias": {str(q): 100}, "logprobs": 1}
    )
    outs = [o for o in engine.outputs() if o.request_id == rid]
    entries = [e for o in outs for e in o.logprobs or []]
    assert [e["token_id"] for e in entries] == [q] * 16
    assert min(e["logprob"] for e in entries) < -1.0
    assert any(e["top_logprobs"][0]["token_id"] != q for e in entries)


def test_logit_bias_outside_the_vocabulary_names_the_field(engine):
    from dlm_engine import InvalidRequestError

    vocab = engine.runner.model_vocab
    with pytest.raises(InvalidRequestError) as err:
        engine.resolve_params({"logit_bias": {str(vocab): 1}})
    assert err.value.field == "logit_bias"
    assert engine.resolve_params({"logit_bias": {"5": -2}}).logit_bias == ((5, -2.0),)
