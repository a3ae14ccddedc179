"""DiffusionGemma's fused sampler statistics (`uniform_diffusion.sampler_statistics`): on the GPU
one compiled pass over the head's product gives the tempered distribution, its argmax and
entropy, and self-conditioning's input. It compiles as one graph and equals the eager
statistics; a row that takes it draws the same calls from its generator from the same
distribution as a row that reads the logits (the GPU's path: `absorb`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm_engine.decoding import uniform_diffusion as ud
from dlm_engine.loader import load_checkpoint
from dlm_lab.testing_diffusion_gemma import generation_settings, make_tiny_diffusion_gemma


def test_statistics_compile_as_one_graph_and_equal_the_eager_ones() -> None:
    torch.manual_seed(0)
    product = (4 * torch.randn(1, 16, 3000)).to(torch.bfloat16)
    temp = torch.tensor(0.7)
    compiled = torch.compile(ud._sampler_statistics, dynamic=True, fullgraph=True)
    got = compiled(product, 30.0, temp)
    want = ud._sampler_statistics(product, 30.0, temp)
    probs, probs_low, argmax, entropy = want
    torch.testing.assert_close(got[0], probs, rtol=1e-4, atol=1e-7)
    assert got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[1], probs_low, rtol=1e-2, atol=1e-5)
    assert torch.equal(got[2], argmax)
    torch.testing.assert_close(got[3], entropy, rtol=1e-4, atol=1e-4)
    # the statistics are the eager path's: the soft-capped, tempered logits' softmax,
    # argmax and entropy
    processed = ud.soft_cap(product, 30.0) / temp
    assert torch.equal(probs, torch.softmax(processed, dim=-1, dtype=torch.float32))
    assert torch.equal(argmax, processed.argmax(dim=-1))
    torch.testing.assert_close(entropy, ud.token_entropy(processed), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg")), "float32")


def _row(loaded, seed: int) -> ud.UniformRow:
    gen = json.loads((Path(loaded.path) / "generation_config.json").read_text())
    settings = generation_settings(loaded.path, 1, loaded.model.canvas_length)
    (row,) = ud.make_rows(loaded.model, [[5, 6, 7]], [settings], [seed], gen["eos_token_id"])
    row.to_encode = None
    row.start_canvas()
    return row


@torch.no_grad()
def test_a_fused_row_draws_as_a_row_that_reads_the_logits(loaded, monkeypatch) -> None:
    model = loaded.model
    plain, fused = _row(loaded, 11), _row(loaded, 11)
    torch.manual_seed(1)
    hidden = torch.randn(1, model.canvas_length, model.arch.hidden_size)
    assert not fused.fuses(hidden, model)  # the CPU reads the logits
    monkeypatch.setattr(ud.UniformRow, "fuses", lambda self, h, m: True)
    for _ in range(3):
        plain.absorb(model.head(hidden), model)
        fused.absorb_hidden(hidden, model)
        assert torch.equal(plain.argmax, fused.argmax)
        torch.testing.assert_close(plain.soft, fused.soft)
        # the same calls on the generator: multinomial over the canvas, randint to renoise
        assert torch.equal(plain.generator.get_state(), fused.generator.get_state())
        assert plain.remaining == fused.remaining and plain.forwards == fused.forwards
