"""OpenAI's `logit_bias` on every family and row kind: a ban changes the greedy token, +100
forces a token at every position, and a biased row batched with others equals itself alone."""

from __future__ import annotations

import pytest

from dlm_engine import Engine, EngineConfig, InvalidRequestError
from dlm_lab.testing import make_tiny_checkpoint
from dlm_protocol import BY_NAME


@pytest.fixture(scope="module")
def sdar(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", "sdar")
    return Engine(EngineConfig(model=str(path), max_rows=8))


@pytest.fixture(scope="module")
def llada2(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llada2", "llada2")
    return Engine(EngineConfig(model=str(path), max_rows=8))


def _family(name: str, engines: dict[str, Engine], sdar: Engine, llada2: Engine) -> Engine:
    return {"sdar": sdar, "llada2": llada2}.get(name) or engines[name]


# one case per row kind: LLaDA / Dream full-canvas rows, cached rows, block-diffusion rows
CASES = [
    ("llada", dict(max_tokens=16, steps=16, block_length=8)),
    ("llada", dict(max_tokens=16, steps=8, block_length=8, cache="prefix")),
    ("llada", dict(max_tokens=16, steps=16, block_length=8, cache="dual")),
    ("dream", dict(max_tokens=16, steps=16)),
    ("dream", dict(max_tokens=16, steps=16, block_length=8, cache="prefix")),
    ("llada", dict(max_tokens=16, block_length=8, multi_block=True)),  # d3LLM's rule
    ("sdar", dict(max_tokens=16, block_length=4)),
    ("sdar", dict(max_tokens=16, block_length=4, algorithm="low_confidence_static")),
    ("llada2", dict(max_tokens=16, block_length=4)),
]
IDS = [
    f"{f}-{c.get('cache', c.get('algorithm', 'multi_block' if c.get('multi_block') else 'exact'))}"
    for f, c in CASES
]


def _prompt(eng: Engine) -> list[int]:
    return eng.encode_prompt(messages=[{"role": "user", "content": "Sort: 5 3 9 1"}])


def _letter(eng: Engine, text: str = "q") -> int:
    (token,) = eng.tokenizer.encode(text, add_special_tokens=False)
    return token


@pytest.mark.parametrize(("family", "case"), CASES, ids=IDS)
def test_a_ban_changes_the_greedy_token(
    family: str, case: dict, engines: dict[str, Engine], sdar: Engine, llada2: Engine
) -> None:
    eng = _family(family, engines, sdar, llada2)
    prompt = _prompt(eng)
    plain = eng.generate([prompt], case)[0].token_ids
    banned = plain[0]
    out = eng.generate([prompt], dict(case, logit_bias={str(banned): -100}))[0].token_ids
    assert out[0] != banned
    assert banned not in out


@pytest.mark.parametrize(("family", "case"), CASES, ids=IDS)
def test_plus_100_forces_a_token_at_every_position(
    family: str, case: dict, engines: dict[str, Engine], sdar: Engine, llada2: Engine
) -> None:
    eng = _family(family, engines, sdar, llada2)
    forced = _letter(eng)
    out = eng.generate([_prompt(eng)], dict(case, logit_bias={forced: 100}))[0]
    assert out.token_ids == [forced] * case["max_tokens"]
    assert out.text == "q" * case["max_tokens"]


def test_bias_comes_before_temperature(engines: dict[str, Engine]) -> None:
    """At temperature 2 the biased logit still dominates: the bias is added before the logits
    are divided (OpenAI's order), not to the tempered ones."""
    eng = engines["llada"]
    forced = _letter(eng)
    case = dict(max_tokens=16, steps=16, temperature=2.0, seed=3, logit_bias={str(forced): 100})
    assert eng.generate([_prompt(eng)], case)[0].token_ids == [forced] * 16


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_biased_rows_batched_equal_each_alone(
    family: str, engines: dict[str, Engine], sdar: Engine, llada2: Engine
) -> None:
    eng = _family(family, engines, sdar, llada2)
    q, z = _letter(eng, "q"), _letter(eng, "z")
    base = (
        dict(max_tokens=16, block_length=4) if family == "sdar" else dict(max_tokens=16, steps=16)
    )
    plain = eng.generate([_prompt(eng)], base)[0].token_ids
    cases = [
        base,
        dict(base, logit_bias={str(plain[0]): -100, str(plain[1]): -50}),
        dict(base, logit_bias={q: 100}),
        dict(base, seed=5, temperature=0.7),
        dict(base, logit_bias={str(z): 4.5, str(plain[2]): -100}),
    ]
    prompts = [
        eng.encode_prompt(messages=[{"role": "user", "content": t}])
        for t in ("Sort: 5 3 9 1", "abc", "What is 2+2?", "Sort: 5 3 9 1", "Reverse abc")
    ]
    alone = [eng.generate([p], c)[0].token_ids for p, c in zip(prompts, cases, strict=True)]
    batched = [o.token_ids for o in eng.generate(prompts, cases)]
    assert batched == alone
    assert alone[2] == [q] * 16


def test_ids_outside_the_vocabulary_are_refused(engines: dict[str, Engine], sdar: Engine) -> None:
    for eng in (engines["llada"], sdar):
        vocab = eng.runner.model_vocab
        with pytest.raises(InvalidRequestError) as err:
            eng.resolve_params({"logit_bias": {str(vocab): 1}})
        assert err.value.field == "logit_bias" and str(vocab) in str(err.value)
        assert eng.resolve_params({"logit_bias": {str(vocab - 1): 1}}).logit_bias == (
            (vocab - 1, 1.0),
        )


@pytest.mark.parametrize(
    "value",
    [
        {"x": 1},
        {"-1": 1},
        {"1": 101},
        {"1": -100.5},
        {"1": "5"},
        {"1": True},
        {"1": float("nan")},
        [1, 2],
        "not json",
        {"1": 1, 1: 2},
        {str(i): 1 for i in range(1025)},
    ],
)
def test_malformed_values_name_the_field(value: object, engines: dict[str, Engine]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["llada"].resolve_params({"logit_bias": value})
    assert err.value.field == "logit_bias"


def test_accepted_forms_normalise_alike(engines: dict[str, Engine]) -> None:
    eng = engines["llada"]
    for value in ({"7": -100, "9": 2}, {7: -100, 9: 2.0}, '{"7": -100, "9": 2}'):
        assert eng.resolve_params({"logit_bias": value}).logit_bias == ((7, -100.0), (9, 2.0))
    assert eng.resolve_params({"logit_bias": {}}).logit_bias is None
    assert eng.resolve_params({"logit_bias": {"7": 0}}).logit_bias is None  # no work at all
    assert BY_NAME["logit_bias"].check({"7": 1}) == {"7": 1}  # forwarded as sent


def test_scoring_refuses_a_bias(engines: dict[str, Engine]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        engines["llada"].resolve_params({"score": True, "logit_bias": {"7": 1}})
    assert err.value.field == "logit_bias"


def test_logprobs_stay_the_models_own(engines: dict[str, Engine]) -> None:
    """A forced token's reported logprob is the unbiased model's (docs: before logit_bias)."""
    eng = engines["llada"]
    forced = _letter(eng)
    case = dict(max_tokens=8, steps=8, block_length=8, logprobs=0)
    eng.add_request("lp", _prompt(eng), dict(case, logit_bias={forced: 100}))
    entries: list[dict] = []
    while eng.has_unfinished():
        for o in eng.step():
            entries += o.logprobs or []
    assert [e["token_id"] for e in entries] == [forced] * 8
    assert all(e["logprob"] < -0.5 for e in entries)  # a random model never favours q


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_grammar_rows_see_the_bias(
    family: str, engines: dict[str, Engine], sdar: Engine, llada2: Engine
) -> None:
    """A banned first letter leaves the grammar one choice: the bias comes before its masks."""
    eng = _family(family, engines, sdar, llada2)
    base = dict(max_tokens=16, choice=["abc", "xyz"])
    if family != "sdar":
        base["steps"] = 16
    for banned, want in (("a", "xyz"), ("x", "abc")):
        case = dict(base, logit_bias={str(_letter(eng, banned)): -100})
        assert eng.generate([_prompt(eng)], case)[0].text == want
