"""`stream_mode: denoise` on DiffusionGemma: every step shows the canvas being denoised, its
renoised positions included (uniform-state diffusion has no masks to show as null), as the
other families show theirs every step; the text and tokens are those of `delta` mode."""

from __future__ import annotations

import pytest
import torch

from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma

pytest.importorskip("transformers")

CANVAS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dlm_engine import Engine, EngineConfig

    ckpt = make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg"), canvas_length=CANVAS)
    return Engine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_rows=4))


def _prompt(engine, text: str) -> list[int]:
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


def _stream(engine, prompt, keys):
    rid = engine.add_request(None, prompt, keys)
    return [o for o in engine.outputs() if o.request_id == rid]


def test_each_step_shows_the_canvas_in_progress(engine, monkeypatch):
    """One output a step; the canvas in progress is the sampler's own (the tokens the next
    step reads: accepted and renoised), finished canvases show their final tokens, canvases
    not begun are null; text and tokens equal delta mode's."""
    from dlm_engine.decoding import uniform_diffusion

    seen: list[list[int]] = []  # the sampler's canvas after each step, as it leaves absorb
    real = uniform_diffusion.UniformRow.absorb

    def spy(self, logits, *args):
        out = real(self, logits, *args)
        seen.append(self.current[0].tolist())
        return out

    monkeypatch.setattr(uniform_diffusion.UniformRow, "absorb", spy)
    prompt = _prompt(engine, "hi there")
    keys = {"seed": 1, "max_tokens": 40, "stop_entropy": 1e-6}  # no early stop here
    outs = _stream(engine, prompt, keys | {"stream_mode": "denoise"})
    monkeypatch.undo()
    plain = engine.generate([prompt], keys)[0]
    final = outs[-1]
    moved = 0
    assert final.finished and final.token_ids == plain.token_ids and final.text == plain.text
    assert "".join(o.delta_text for o in outs) == plain.text
    assert [o.steps for o in outs] == list(range(1, final.steps + 1))  # one output a step
    assert len(seen) == final.steps
    tok = engine.tokenizer
    steps = engine.resolve_params(keys).uniform.steps  # per canvas (no early stop here)
    for out, current in zip(outs, seen, strict=True):
        shown = out.canvas
        assert len(shown) == 40
        canvases = out.steps // steps  # finished by this step
        start = canvases * CANVAS
        assert shown[:start] == final.canvas[:start]  # finished canvases show their tokens
        if out.steps % steps and not out.finished:  # inside a canvas: the sampler's own
            live = shown[start : start + CANVAS]
            assert live == [tok.decode([t]) for t in current[: len(live)]]
            assert all(s is None for s in shown[start + CANVAS :])  # not begun
            moved += 1
        else:  # a canvas ended at this step: what follows it is not begun
            assert all(s is None for s in shown[start:])
    assert moved >= 20  # the animation has frames
    frames = {tuple(o.canvas) for o in outs}
    assert len(frames) > final.steps // 2  # renoising changes the canvas step after step


def test_denoise_rows_batched_equal_each_alone(engine):
    prompts = [_prompt(engine, t) for t in ("hi there", "sort 4 2 9")]
    keys = [
        {"seed": 2, "max_tokens": 24, "stream_mode": "denoise"},
        {"seed": 3, "max_tokens": 16},
    ]
    together = engine.generate(prompts, keys)
    for prompt, k, out in zip(prompts, keys, together, strict=True):
        alone = engine.generate([prompt], {**k, "stream_mode": "delta"})[0]
        assert out.token_ids == alone.token_ids


def test_a_finished_answer_shows_its_final_canvas(engine):
    prompt = _prompt(engine, "abc")
    outs = _stream(engine, prompt, {"seed": 4, "max_tokens": 16, "stream_mode": "denoise"})
    final = outs[-1]
    shown = final.canvas
    tok = engine.tokenizer
    n = len(final.token_ids)
    assert shown[:n] == [tok.decode([t]) for t in final.token_ids]
    assert torch.tensor([s is not None for s in shown]).all()  # one canvas, all of it final
