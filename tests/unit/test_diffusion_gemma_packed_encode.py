"""DiffusionGemma's encoder runs one packed forward a step over every row with tokens to
encode, under the `encode_step_tokens` budget (a long prompt in chunks over several steps
while the other rows keep denoising); tokens stay those of each row alone, and those of
transformers' `generate` at batch 1.

CPU float32 rounds an elementwise kernel's vectorised body and its tail differently, so a
span encoded at another offset or in another chunk can differ in the last bit of a float:
the caches are compared to float32 rounding, the tokens exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm_engine.models.diffusion_gemma import RowCache
from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma, served_alone, spy_encoder

pytest.importorskip("transformers")

CANVAS = 16
LONG = (
    "Summarise this: the quick brown fox jumps over the lazy dog, then the dog wakes up, "
    "chases the fox across the field and both end up asleep under the old oak tree."
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dgp"), canvas_length=CANVAS)


def _engine(ckpt: Path, budget: int):
    from dlm_engine import Engine, EngineConfig

    return Engine(
        EngineConfig(
            model=str(ckpt), device="cpu", dtype="float32", max_rows=4, encode_step_tokens=budget
        )
    )


@pytest.fixture(scope="module")
def wide(ckpt):
    return _engine(ckpt, 8192)  # every pending span in one forward


@pytest.fixture(scope="module")
def narrow(ckpt):
    return _engine(ckpt, 7)  # prompts and canvases in chunks of at most 7 tokens


def _prompt(engine, text: str) -> list[int]:
    return engine.encode_prompt(messages=[{"role": "user", "content": text}])


def _run(engine, reqs: dict[str, tuple[list[int], dict]]) -> dict[str, object]:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_rows_admitted_together_are_encoded_in_one_forward(wide, monkeypatch):
    calls = spy_encoder(wide, monkeypatch)
    reqs = {
        "a": (_prompt(wide, "hi there"), {"seed": 1, "max_tokens": 40}),
        "b": (_prompt(wide, "What is 12 + 7? Answer briefly."), {"seed": 3, "max_tokens": 20}),
        "c": (_prompt(wide, LONG), {"seed": 6, "max_tokens": 32, "stop_entropy": 0.3}),
    }
    forwards = wide.runner.encoder_forwards
    for rid, (prompt, params) in reqs.items():
        wide.add_request(rid, prompt, params)
    wide.step()
    # one encoder forward for the three prompts, whole, in arrival order
    assert calls == [[len(reqs[r][0]) for r in "abc"]]
    assert wide.runner.encoder_forwards == forwards + 1
    final = {}
    while wide.has_unfinished():
        final |= {o.request_id: o for o in wide.step() if o.finished}
    # canvases that end in the same step are encoded together too: never more forwards than
    # steps, and fewer than one per span
    spans = sum(len(c) for c in calls)
    assert len(calls) <= wide.total_forwards and len(calls) < spans
    for rid, (prompt, params) in reqs.items():
        want = served_alone(wide, prompt, params)
        assert final[rid].token_ids[: len(want)] == want, rid
        assert final[rid].finish_reason in ("stop", "length")


def test_long_prompt_encoded_in_chunks_while_others_keep_stepping(narrow, monkeypatch):
    calls = spy_encoder(narrow, monkeypatch)
    short = _prompt(narrow, "hi")
    long = _prompt(narrow, LONG)
    assert len(long) > 10 * 7
    short_params = {"seed": 2, "max_tokens": 64, "stop_entropy": 1e-9}  # all its steps
    long_params = {"seed": 5, "max_tokens": 32}
    narrow.add_request("short", short, short_params)
    while narrow.runner.rows.get("short") is None or narrow.runner.rows["short"].encoding:
        narrow.step()  # its prompt in chunks of at most 7 tokens, then it denoises
    narrow.add_request("long", long, long_params)
    runner = narrow.runner
    stepped_while_long_encoded = 0
    final = {}
    while narrow.has_unfinished():
        row = runner.rows.get("short")
        before = None if row is None else (row.forwards, row.encoding)
        final |= {o.request_id: o for o in narrow.step() if o.finished}
        long_row = runner.rows.get("long")
        # while the long prompt is being encoded, the short row (with nothing to encode
        # itself) denoises every step
        if before is not None and long_row is not None and long_row.encoding and not before[1]:
            assert row.forwards == before[0] + 1
            stepped_while_long_encoded += 1
    assert all(sum(c) <= 7 for c in calls)  # the budget, every step
    # the long prompt went through the encoder in chunks over many steps, beside the short
    # row's denoising steps
    assert sum(1 for c in calls if c) >= len(long) // 7
    assert stepped_while_long_encoded >= len(long) // 7 - 3
    for rid, prompt, params in (("short", short, short_params), ("long", long, long_params)):
        want = served_alone(narrow, prompt, params)
        assert final[rid].token_ids[: len(want)] == want, rid


def test_chunked_and_packed_encoding_leaves_the_cache_of_one_whole_forward(narrow):
    """Chunks of many sizes (below, at and across the sliding window of 6), each packed with
    other rows' spans: every layer's keys and values equal one forward over the whole prompt
    to float32 rounding, with the same kept positions (sliding layers: the last 5)."""
    model = narrow.runner.model
    layers = len(model.model.decoder.layers)
    long = torch.tensor(_prompt(narrow, LONG))
    other = torch.tensor(_prompt(narrow, "abc"))
    whole = RowCache(layers, room=CANVAS)
    model.encode([(long, whole)])
    n = long.numel()
    for chunk in (1, 2, 5, 6, 7, 13, n - 1):
        cache, neighbour = RowCache(layers, room=CANVAS), RowCache(layers, room=CANVAS)
        for start in range(0, n, chunk):
            spans = [(long[start : start + chunk], cache)]
            if neighbour.length < other.numel():  # a neighbour packed before it
                spans.insert(0, (other[neighbour.length : neighbour.length + 3], neighbour))
            model.encode(spans)
        assert cache.length == whole.length == n
        for i in range(layers):
            for got, want in ((cache.keys[i], whole.keys[i]), (cache.values[i], whole.values[i])):
                assert got.shape == want.shape, (chunk, i)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_encoding_serves_transformers_tokens_at_batch_1(narrow, ckpt):
    """A prompt encoded 7 tokens a step (and each finished canvas in chunks) gives the tokens
    of transformers' generate over the whole prompt, and as many denoising steps as the
    request alone (steps that only encoded are not counted)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt)).eval()
    gen = json.loads((ckpt / "generation_config.json").read_text())
    prompt = _prompt(narrow, "What is 12 + 7? Answer briefly, please.")
    for seed, max_tokens in ((3, 48), (8, 32)):
        torch.manual_seed(seed)
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens)
        want = out.sequences[0, len(prompt) :].tolist()
        stops = gen["eos_token_id"]
        cut = next((i for i, t in enumerate(want) if t in stops), len(want))
        served = _run(narrow, {"r": (prompt, {"seed": seed, "max_tokens": max_tokens})})["r"]
        assert served.token_ids == want[:cut]
        wide = _run(_engine(ckpt, 8192), {"r": (prompt, {"seed": seed, "max_tokens": max_tokens})})
        assert served.steps == wide["r"].steps


def test_rows_joining_and_cancelled_mid_flight_under_a_small_budget(narrow):
    """Unlike rows (prompt lengths, seeds, settings) join while others denoise, one is
    cancelled while its prompt is still being encoded, one after it started: the others'
    tokens are each alone's."""
    reqs = {
        "a": (_prompt(narrow, "hi there"), {"seed": 1, "max_tokens": 40}),
        "b": (_prompt(narrow, LONG), {"seed": 3, "max_tokens": 20}),
        "c": (_prompt(narrow, "sort 4 2 9"), {"seed": 6, "max_tokens": 64, "stop_entropy": 0.3}),
        "d": (_prompt(narrow, "abc"), {"seed": 8, "max_tokens": 32, "steps": 5}),
        "e": (_prompt(narrow, LONG + " Twice."), {"seed": 9, "max_tokens": 16}),
    }
    final = {}

    def step(n: int) -> None:
        for _ in range(n):
            final.update({o.request_id: o for o in narrow.step() if o.finished})

    narrow.add_request("a", *reqs["a"])
    narrow.add_request("b", *reqs["b"])
    step(3)
    narrow.add_request("c", *reqs["c"])
    narrow.add_request("e", *reqs["e"])
    step(2)
    assert narrow.runner.rows["e"].encoding  # still in its prompt
    narrow.abort("e")
    narrow.add_request("d", *reqs["d"])
    step(6)
    assert "a" not in final and narrow.runner.rows["a"].forwards > 0  # denoising
    narrow.abort("a")
    while narrow.has_unfinished():
        step(1)
    assert final["a"].finish_reason == "abort" and final["e"].finish_reason == "abort"
    for rid in "bcd":
        want = served_alone(narrow, *reqs[rid])
        assert final[rid].token_ids[: len(want)] == want, rid


def test_admission_counts_a_row_s_canvas_not_its_prompt(ckpt, monkeypatch):
    """A DiffusionGemma row feeds its decoder one canvas a step (its prompt goes through the
    encoder under `encode_step_tokens`), so `max_step_tokens` of four canvases admits four
    rows at once, where counting prompt + `max_tokens` would admit one a step; their prompts
    are encoded in one forward."""
    from dlm_engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=str(ckpt), device="cpu", dtype="float32", max_rows=4, max_step_tokens=4 * CANVAS
        )
    )
    calls = spy_encoder(engine, monkeypatch)
    texts = ["hi there", "abc", "sort 4 2 9", "What is 12 + 7?"]
    prompts = [_prompt(engine, t) for t in texts]
    assert all(len(p) + 32 > 4 * CANVAS // 2 for p in prompts)  # prompt + canvas: one fits
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, {"seed": i, "max_tokens": 32})
    engine.step()
    assert engine.num_running == 4 and engine.num_waiting == 0
    assert calls == [[len(p) for p in prompts]]
    final = {}
    while engine.has_unfinished():
        final |= {o.request_id: o for o in engine.step() if o.finished}
    for i, p in enumerate(prompts):
        want = served_alone(engine, p, {"seed": i, "max_tokens": 32})
        assert final[str(i)].token_ids[: len(want)] == want
