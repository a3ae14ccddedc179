"""DiffusionGemma's encoder prefix cache (dlm_engine/encoder_prefix.py): a prompt's leading
chunks, encoded once, are copied into later rows' caches instead of being encoded again.

A cached prefix was encoded in another row's forward (another length, other rows packed
beside it), and CPU float32 rounds a kernel's vectorised body and its tail differently, so
a copied cache equals a fresh encode to float32 rounding, not bit for bit (as chunked
encoding, test_diffusion_gemma_packed_encode.py): caches are compared to rounding, tokens
exactly, against the cache off and against transformers' generate. Chunks here are 8 tokens
(256 served) so the tiny checkpoint's sliding window of 6 is met inside, at and across
chunk edges.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlm_engine.encoder_prefix import CPU_BYTES, EncoderPrefixCache, fill
from dlm_engine.errors import InvalidRequestError
from dlm_engine.models.diffusion_gemma import RowCache
from dlm_lab.testing_diffusion_gemma import make_tiny_diffusion_gemma, served_alone, spy_encoder

pytest.importorskip("transformers")

CANVAS = 16
CHUNK = 8
SYSTEM = "You are a careful assistant. Answer every question in one short line, no more."
QUESTIONS = ["hi there", "What is 12 + 7?", "sort 4 2 9", "abc"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_diffusion_gemma(tmp_path_factory.mktemp("dgpc"), canvas_length=CANVAS)


def _engine(ckpt: Path, budget: int | None, chunk: int = CHUNK, step_tokens: int = 16):
    from dlm_engine import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            model=str(ckpt),
            device="cpu",
            dtype="float32",
            max_rows=4,
            encode_step_tokens=step_tokens,
            encoder_prefix_cache_bytes=budget,
        )
    )
    if budget:  # the served chunk (256) is longer than these prompts
        engine.runner.prefix_cache = EncoderPrefixCache(budget, chunk_tokens=chunk)
    return engine


def _prompt(engine, question: str, system: str = SYSTEM) -> list[int]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return engine.encode_prompt(messages=msgs)


def _run(engine, reqs: dict[str, tuple[list[int], dict]]) -> dict[str, object]:
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished():
        final |= {o.request_id: o for o in engine.step() if o.finished}
    return final


def _shared(prompts: list[list[int]]) -> int:
    """Tokens the prompts share from the start."""
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def test_a_filled_cache_equals_an_encode_of_the_prefix(ckpt):
    """Chunks of 1, 2, 5, 6 and 8 tokens (below, at and across the sliding window of 6), hits
    of one chunk, half the prompt and all its chunks: the cache filled from a longer
    prompt's recorded chunks holds what an encode of the prefix alone leaves, every layer (sliding layers: the last 5 positions), to float32
    rounding; the rest encoded on top equals the whole prompt encoded at once."""
    engine = _engine(ckpt, 0)
    model = engine.runner.model
    layers = model.model.decoder.layers
    sliding = [layer.self_attn.shape.sliding for layer in layers]
    assert any(sliding) and not all(sliding)
    prompt = _prompt(engine, "What is 12 + 7?")
    ids = torch.tensor(prompt)
    whole = RowCache(len(layers), room=CANVAS)
    model.encode([(ids, whole)])
    for chunk in (1, 2, 5, 6, 8):
        store = EncoderPrefixCache(1 << 30, chunk_tokens=chunk)
        hashes = store.hashes(prompt, None)
        source = RowCache(len(layers), room=CANVAS)
        source.record_upto = len(hashes) * chunk
        for start in range(0, len(prompt), 7):  # in chunks, another row packed before it
            model.encode([(ids[:3], RowCache(len(layers))), (ids[start : start + 7], source)])
        store.insert(hashes, *source.take_recorded(len(hashes) * chunk))
        for cut in sorted({chunk, len(hashes) // 2 * chunk, len(hashes) * chunk}):
            hit = store.match(store.hashes(prompt[:cut], None))
            assert len(hit) == cut // chunk
            filled = RowCache(len(layers), room=CANVAS)
            fresh = RowCache(len(layers), room=CANVAS)
            assert fill(filled, hit, sliding, model.arch.sliding_window) == cut
            model.encode([(ids[:cut], fresh)])
            for got_cache, want_cache in ((filled, fresh), (None, whole)):
                if got_cache is None:  # then the rest of the prompt on top of the filled cache
                    if cut < len(prompt):
                        model.encode([(ids[cut:], filled)])
                    got_cache = filled
                assert got_cache.length == want_cache.length
                for i in range(len(layers)):
                    pairs = (
                        (got_cache.keys[i], want_cache.keys[i]),
                        (got_cache.values[i], want_cache.values[i]),
                    )
                    for got, want in pairs:
                        assert got.shape == want.shape, (chunk, cut, i)
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hits_give_the_tokens_of_the_cache_off(ckpt, monkeypatch):
    """Prompts sharing a system prompt, different questions; one row alone first, then rows
    joining while it denoises (prompts chunked 16 tokens a step): every row's tokens equal
    the cache off and the sampler alone, the later rows encode only what follows the cached
    chunks, and the engine counts the hits as the block families' prefix cache does."""
    on, off = _engine(ckpt, 1 << 20), _engine(ckpt, 0)
    assert off.runner.prefix_cache is None
    prompts = [_prompt(on, q) for q in QUESTIONS]
    shared = _shared(prompts) // CHUNK * CHUNK
    assert shared >= 8 * CHUNK
    reqs = {
        str(i): (p, {"seed": i, "max_tokens": 16 + 16 * (i == 0)}) for i, p in enumerate(prompts)
    }
    results = {}
    for name, engine in (("on", on), ("off", off)):
        calls = spy_encoder(engine, monkeypatch)
        engine.add_request("0", *reqs["0"])
        final = {}
        while engine.runner.rows.get("0") is None or engine.runner.rows["0"].encoding:
            final |= {o.request_id: o for o in engine.step() if o.finished}
        encoded_first = sum(map(sum, calls))
        engine.add_request("1", *reqs["1"])
        final |= {o.request_id: o for o in engine.step() if o.finished}
        engine.add_request("2", *reqs["2"])
        engine.add_request("3", *reqs["3"])
        while engine.has_unfinished():
            final |= {o.request_id: o for o in engine.step() if o.finished}
        results[name] = final
        results[name + "_encoded"] = (encoded_first, sum(map(sum, calls)) - encoded_first)
    for rid, (prompt, params) in reqs.items():
        got = results["on"][rid]
        assert got.token_ids == results["off"][rid].token_ids, rid
        if rid in "02":
            assert got.token_ids[: len(served_alone(on, prompt, params))] == served_alone(
                on, prompt, params
            )
        assert got.cached_tokens == (0 if rid == "0" else shared), rid
        assert results["off"][rid].cached_tokens == 0
    # the first row encodes its whole prompt either way; each later one 'shared' fewer
    # (finished canvases are encoded too, the same number with the cache on or off)
    assert results["on_encoded"][0] == results["off_encoded"][0] == len(prompts[0])
    assert results["off_encoded"][1] - results["on_encoded"][1] == 3 * shared
    cache = on.runner.prefix_cache
    whole_chunks = sum(len(p) // CHUNK * CHUNK for p in prompts)
    assert (cache.lookup_tokens, cache.hit_tokens) == (whole_chunks, 3 * shared)


def test_a_hit_serves_transformers_tokens(ckpt):
    """A request whose prefix comes from the cache gives the tokens of transformers'
    generate over its whole prompt."""
    from transformers import DiffusionGemmaForBlockDiffusion

    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(str(ckpt)).eval()
    engine = _engine(ckpt, 1 << 20)
    stops = json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    _run(engine, {"warm": (_prompt(engine, "abc"), {"seed": 0, "max_tokens": 16})})
    prompt = _prompt(engine, "What is 12 + 7? Answer briefly, please.")
    for seed, max_tokens in ((3, 32),):
        torch.manual_seed(seed)
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens)
        want = out.sequences[0, len(prompt) :].tolist()
        cut = next((i for i, t in enumerate(want) if t in stops), len(want))
        served = _run(engine, {"r": (prompt, {"seed": seed, "max_tokens": max_tokens})})["r"]
        assert served.cached_tokens >= 8 * CHUNK
        assert served.token_ids == want[:cut]


def test_a_different_cache_salt_never_shares(ckpt, monkeypatch):
    engine = _engine(ckpt, 1 << 20, step_tokens=8192)
    calls = spy_encoder(engine, monkeypatch)
    prompt = _prompt(engine, "hi there, you")
    assert len(prompt) % CHUNK  # a prompt forward after the hit, even when all chunks hit
    whole = len(prompt) // CHUNK * CHUNK

    def cached(salt: str | None) -> int:
        params = {"seed": 1, "max_tokens": 16, **({"cache_salt": salt} if salt else {})}
        calls.clear()
        out = _run(engine, {"r": (prompt, params)})["r"]
        assert calls[0] == [len(prompt) - out.cached_tokens]  # the prompt's own forward
        return out.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") == whole
    assert cached("tenant-b") == whole
    assert cached(None) == whole
    assert engine.runner.prefix_cache.hit_tokens == 3 * whole
    with pytest.raises(InvalidRequestError) as err:  # validated as for the other families
        engine.resolve_params({"seed": 1, "cache_salt": ""})
    assert err.value.field == "cache_salt"


def test_least_recently_used_chunks_go_first_under_a_tiny_budget(ckpt):
    """A budget of three chunks: a second prompt's chunks push out the first one's tail, not
    its head, so the first prompt still finds its first chunk; nothing exceeds the budget."""
    probe = _engine(ckpt, 1 << 20)
    a = probe.encode_prompt(text="Alpha: the first prompt, here.")[: 2 * CHUNK + 3]
    b = probe.encode_prompt(text="Beta: another prompt, there.")[: 2 * CHUNK + 3]
    assert a[0] != b[0]
    params = {"seed": 0, "max_tokens": 16}
    _run(probe, {"a": (a, params)})
    chunk_bytes = probe.runner.prefix_cache.bytes // 2
    engine = _engine(ckpt, 3 * chunk_bytes)
    cache = engine.runner.prefix_cache
    assert _run(engine, {"a": (a, params)})["a"].cached_tokens == 0
    assert _run(engine, {"b": (b, params)})["b"].cached_tokens == 0
    # b's second chunk evicted a's second, the least recently used (a's first is touched last)
    assert (len(cache.chunks), cache.evictions, cache.bytes) == (3, 1, 3 * chunk_bytes)
    assert _run(engine, {"a2": (a, params)})["a2"].cached_tokens == CHUNK
    assert _run(engine, {"b2": (b, params)})["b2"].cached_tokens == CHUNK
    assert _run(engine, {"a3": (a, params)})["a3"].cached_tokens == CHUNK
    assert cache.bytes <= cache.budget_bytes and cache.evictions == 4
    tiny = _engine(ckpt, chunk_bytes - 1)  # no chunk fits: nothing stored, nothing breaks
    _run(tiny, {"a": (a, params)})
    assert _run(tiny, {"a": (a, params)})["a"].cached_tokens == 0
    assert tiny.runner.prefix_cache.bytes == 0


def test_budget_zero_turns_it_off_and_auto_is_modest_on_cpu(ckpt, monkeypatch):
    from dlm_engine import EngineConfig

    off = _engine(ckpt, 0, step_tokens=8192)
    assert off.runner.prefix_cache is None
    calls = spy_encoder(off, monkeypatch)
    prompt = _prompt(off, "hi there")
    for rid in ("a", "b"):
        calls.clear()
        assert _run(off, {rid: (prompt, {"seed": 1, "max_tokens": 16})})[rid].cached_tokens == 0
        assert calls[0][0] == len(prompt)
    auto = _engine(ckpt, None)
    assert auto.runner.prefix_cache.budget_bytes == CPU_BYTES
    assert auto.runner.prefix_cache.chunk_tokens == 256
    with pytest.raises(ValueError, match="encoder_prefix_cache_bytes must be >= 0"):
        EngineConfig(model="x", encoder_prefix_cache_bytes=-1)


def test_a_request_aborted_mid_prompt_stores_nothing(ckpt):
    """Chunks are stored once encoded whole; a row cancelled before that leaves none."""
    engine = _engine(ckpt, 1 << 20, step_tokens=4)
    prompt = _prompt(engine, "sort 4 2 9")
    engine.add_request("r", prompt, {"seed": 2, "max_tokens": 16})
    engine.step()
    engine.step()
    assert engine.runner.rows["r"].encoding
    engine.abort("r")
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.prefix_cache.bytes == 0 and not engine.runner._chunk_hashes


def test_a_prompt_cached_whole_starts_denoising_at_once(ckpt, monkeypatch):
    """A prompt of whole chunks, all cached: nothing of it is encoded, and its tokens are
    the first run's."""
    engine = _engine(ckpt, 1 << 20)
    prompt = _prompt(engine, "abc")
    prompt = prompt[: len(prompt) // CHUNK * CHUNK]
    params = {"seed": 4, "max_tokens": 16}
    first = _run(engine, {"a": (prompt, params)})["a"]
    calls = spy_encoder(engine, monkeypatch)
    engine.add_request("b", prompt, params)
    engine.step()
    assert calls == [] and engine.runner.rows["b"].forwards == 1
    second = _run(engine, {})["b"]
    assert second.cached_tokens == len(prompt) and second.token_ids == first.token_ids


def test_a_recording_cut_short_stores_nothing():
    """Chunks are stored only when every layer recorded every position (an encode that
    failed part-way leaves some layers short)."""
    cache = RowCache(3)
    cache.record_upto = 8
    k = torch.randn(2, 10, 4)
    for i in range(3):
        cache.note(i, 0, k, k)
    assert [len(r) for r in cache.recorded] == [1, 1, 1]
    keys, _ = cache.take_recorded(8)
    assert [t.shape[1] for t in keys] == [8, 8, 8] and torch.equal(keys[0], k[:, :8])
    assert cache.record_upto == 0 and cache.recorded == [[], [], []]
    cache.record_upto = 8
    cache.note(0, 0, k, k)  # layers 1 and 2 never reached
    assert cache.take_recorded(8) is None and cache.record_upto == 0
