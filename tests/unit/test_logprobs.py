"""Log-probabilities of committed tokens: each reported value is recomputed by an
independent full forward over the canvas as it was before the committing step, batching
changes nothing, and rows that did not ask get nothing."""

from __future__ import annotations

import math

import pytest
import torch

from dlm_engine import Engine, InvalidRequestError, RequestOutput
from dlm_engine.models.common import full_logits

MSG = [{"role": "user", "content": "Sort: 5 3 9 1"}]


def _run(eng: Engine, requests: dict[str, tuple[list[int], dict]]) -> dict[str, list]:
    """Every output of each request, in order."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for out in eng.outputs():
        outs[out.request_id].append(out)
    return outs


def _entries(outs: list[RequestOutput]) -> list[dict]:
    return [e for o in outs for e in (o.logprobs or [])]


def _text(eng: Engine, entries: list[dict]) -> str:
    special = {i for i, t in eng.tokenizer.added_tokens_decoder.items() if t.special}
    return "".join(e["token"] for e in entries if e["token_id"] not in special)


def _recompute(eng: Engine, prompt: list[int], entries: list[dict], temperature: float) -> None:
    """Each entry equals log_softmax(logits / T) of its token at its position, with logits from
    a fresh full forward over the canvas before its step (tokens of earlier steps, masks)."""
    model, shift, mask = eng.runner.model, eng.runner.shift, eng.mask_id
    call = full_logits(model)
    t = temperature if temperature > 0 else 1.0
    for step in sorted({e["step"] for e in entries}):
        canvas = [e["token_id"] if e["step"] < step else mask for e in entries]
        x = torch.tensor([prompt + canvas])
        with torch.inference_mode():
            logp = torch.log_softmax(call(x)[0].float() / t, dim=-1)
        for pos, e in enumerate(entries):
            if e["step"] != step:
                continue
            row = logp[len(prompt) + pos - shift]
            assert e["logprob"] == pytest.approx(row[e["token_id"]].item(), abs=1e-4), (pos, step)
            top = torch.topk(row, len(e["top_logprobs"]))
            assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
            ids = [a["token_id"] for a in e["top_logprobs"]]
            assert row[ids].tolist() == pytest.approx(top.values.tolist(), abs=1e-4)
            assert e["logprob"] <= e["top_logprobs"][0]["logprob"] + 1e-5


@pytest.mark.parametrize(
    ("family", "params"),
    [
        ("llada", {"max_tokens": 16, "steps": 16, "block_length": 8}),
        ("llada", {"max_tokens": 16, "steps": 8, "block_length": 8, "temperature": 0.7, "seed": 3}),
        ("llada", {"max_tokens": 16, "algorithm": "threshold", "threshold": 0.3}),
        ("dream", {"max_tokens": 16, "steps": 16}),
        ("dream", {"max_tokens": 16, "steps": 8, "temperature": 0.5, "top_p": 0.9, "seed": 5}),
    ],
    ids=["llada-greedy", "llada-sampled", "llada-threshold", "dream-greedy", "dream-top-p"],
)
def test_logprob_is_the_distribution_at_the_committing_step(
    engines: dict[str, Engine], family: str, params: dict
) -> None:
    eng = engines[family]
    prompt = eng.encode_prompt(messages=MSG)
    params = {**params, "logprobs": 3, "suppress_eos": family == "llada"}
    outs = _run(eng, {"r": (prompt, params)})["r"]
    final = outs[-1]
    entries = _entries(outs)
    assert final.finish_reason == "length", "the whole canvas is needed to rebuild each step"
    assert [e["token_id"] for e in entries] == final.token_ids
    assert len(entries) == params["max_tokens"]
    assert all(len(e["top_logprobs"]) == 3 for e in entries)
    # steps: each in [1, forwards] (Dream's schedule may commit nothing in a step)
    steps = {e["step"] for e in entries}
    assert steps <= set(range(1, final.steps + 1)) and max(steps) == final.steps
    if family == "llada" and "threshold" not in params:  # one token per step, in order
        assert steps == set(range(1, final.steps + 1))
    # the entries' texts (special tokens spelled out) and bytes are the completion's
    assert _text(eng, entries) == final.text
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in entries)
    _recompute(eng, prompt, entries, params.get("temperature", 0.0))


def test_logprobs_stream_with_the_text(engines: dict[str, Engine]) -> None:
    """Each output's entries are the tokens of its delta text (char tokenizer: one each)."""
    eng = engines["llada"]
    prompt = eng.encode_prompt(messages=MSG)
    params = {"max_tokens": 32, "steps": 32, "block_length": 4, "logprobs": 0}
    outs = _run(eng, {"r": (prompt, params)})["r"]
    assert len(outs) > 2
    for o in outs:
        assert _text(eng, o.logprobs) == o.delta_text
        assert all(e["top_logprobs"] == [] for e in o.logprobs)
        assert all(math.isfinite(e["logprob"]) and e["logprob"] <= 0 for e in o.logprobs)


def test_batched_equals_alone_and_other_rows_pay_nothing(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    p1 = eng.encode_prompt(messages=MSG)
    p2 = eng.encode_prompt(messages=[{"role": "user", "content": "abc"}])
    want = {"max_tokens": 16, "steps": 8, "block_length": 8, "temperature": 0.9, "seed": 11}
    alone = _entries(_run(eng, {"a": (p1, {**want, "logprobs": 5})})["a"])
    plain_alone = _run(eng, {"b": (p2, {"max_tokens": 24, "steps": 24})})["b"]
    batched = _run(
        eng,
        {
            "a": (p1, {**want, "logprobs": 5}),
            "b": (p2, {"max_tokens": 24, "steps": 24}),
            "c": (p2, {"max_tokens": 8, "logprobs": 20, "temperature": 0.5, "seed": 1}),
            "d": (p1, {"max_tokens": 16, "cache": "dual", "logprobs": 1}),
        },
    )
    together = _entries(batched["a"])
    assert [e["token_id"] for e in together] == [e["token_id"] for e in alone]
    assert [e["step"] for e in together] == [e["step"] for e in alone]
    assert [e["logprob"] for e in together] == pytest.approx(
        [e["logprob"] for e in alone], abs=1e-5
    )
    for a, b in zip(together, alone, strict=True):
        assert [t["token_id"] for t in a["top_logprobs"]] == [
            t["token_id"] for t in b["top_logprobs"]
        ]
    # the row that did not ask: no logprobs, same tokens as alone
    assert all(o.logprobs is None for o in batched["b"])
    assert batched["b"][-1].token_ids == plain_alone[-1].token_ids
    assert all(len(e["top_logprobs"]) == 20 for e in _entries(batched["c"]))
    assert _entries(batched["d"]), "cached rows record the forward they ran"


def test_logprobs_key_is_checked(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    for bad in (21, -1, True, "2", 1.5):
        with pytest.raises(InvalidRequestError) as err:
            eng.resolve_params({"logprobs": bad})
        assert err.value.field == "logprobs"
    assert eng.resolve_params({"logprobs": 0}).logprobs == 0
    assert eng.resolve_params({}).logprobs is None
