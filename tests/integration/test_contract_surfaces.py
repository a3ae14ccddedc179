"""One request contract, three ways in: for every key of `dlm_protocol.PARAMS`, a valid and an
invalid value sent through the OpenAI proxy, Triton gRPC and Triton HTTP give the same outcome
and name the same field. Plus the diffusion accounting (`forwards`, `tokens_per_forward`,
`max_nfe`) on every surface. One session tritonserver + one proxy; requests run concurrently.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import proxy_fixtures
import pytest
from dlm_client import DLMClient, DLMError

from dlm_protocol import PARAMS
from dlm_protocol.params import BLOCK_DIFFUSION_ONLY, UNIFORM_ONLY

pytestmark = pytest.mark.integration

proxy = proxy_fixtures.proxy
model = proxy_fixtures.model

MSG = [{"role": "user", "content": "hi"}]
BASE = {"max_tokens": 8}
FIELD = re.compile(r"invalid request: (\w+):")

Outcome = tuple[str, str | None]  # ("ok", None) | ("invalid", field) | ("other", message)


def _keys(name: str, value: Any) -> dict[str, Any]:
    return {**BASE, name: value}


# chat's `logprobs` is OpenAI's boolean: the contract's valid count (the completions and
# Triton form) is sent to chat as `true`; the invalid count stays a count (refused by name)
LOGPROBS_VALID = next(p.examples[0] for p in PARAMS if p.name == "logprobs")


def via_proxy(base_url: str, model: str, keys: dict[str, Any]) -> Outcome:
    body = {"model": model, "messages": MSG, **keys}
    if body.get("logprobs") == LOGPROBS_VALID:
        body["logprobs"] = True
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    if r.status_code == 200:
        usage = r.json()["usage"]
        assert usage["forwards"] > 0, usage
        return ("ok", None)
    err = r.json()["error"]
    return ("invalid", err["param"]) if r.status_code == 400 else ("other", err["message"])


def via_grpc(client: DLMClient, keys: dict[str, Any]) -> Outcome:
    try:
        done = client.generate(messages=MSG, **keys)
    except DLMError as exc:
        m = FIELD.search(str(exc))
        return ("invalid", m.group(1)) if m else ("other", str(exc))
    assert done.forwards > 0
    return ("ok", None)


def via_http(client: DLMClient, keys: dict[str, Any]) -> Outcome:
    body = {"messages": json.dumps(MSG), "sampling_parameters": json.dumps(keys)}
    url = f"{client.http_url}/v2/models/{client.model}/generate"
    r = httpx.post(url, json=body, timeout=120)
    if r.status_code == 200:
        assert r.json()["forwards"] > 0
        return ("ok", None)
    message = str(r.json().get("error", r.text))
    m = FIELD.search(message)
    return ("invalid", m.group(1)) if m else ("other", message)


CASES = [(p.name, kind, p.examples[i]) for p in PARAMS for i, kind in enumerate(("valid", "bad"))]


def test_every_key_same_outcome_and_field_on_all_surfaces(proxy, client, model) -> None:
    surfaces = {
        "proxy": lambda keys: via_proxy(proxy.base_url, model, keys),
        "grpc": lambda keys: via_grpc(client, keys),
        "http": lambda keys: via_http(client, keys),
    }
    jobs = [(case, surface) for case in CASES for surface in surfaces]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda job: surfaces[job[1]](_keys(job[0][0], job[0][2])), jobs))
    table: dict[tuple[str, str], dict[str, Outcome]] = {}
    for ((name, kind, _), surface), outcome in zip(jobs, results, strict=True):
        table.setdefault((name, kind), {})[surface] = outcome
    problems = []
    for (name, kind), by_surface in table.items():
        # a block-diffusion or DiffusionGemma key's valid value is still refused, by name, by
        # this LLaDA model
        ok = kind == "valid" and name not in BLOCK_DIFFUSION_ONLY + UNIFORM_ONLY
        want = ("ok", None) if ok else ("invalid", name)
        if any(outcome != want for outcome in by_surface.values()):
            problems.append(f"{name} {kind}: {by_surface}")
    assert not problems, "\n".join(problems)


def test_bad_values_as_triton_request_parameters(client) -> None:
    """The other way in over HTTP: keys as top-level request parameters (scalars only)."""
    url = f"{client.http_url}/v2/models/{client.model}/generate"
    for p in PARAMS:
        bad = p.examples[1]
        if isinstance(bad, list):
            continue
        r = httpx.post(url, json={"messages": json.dumps(MSG), **BASE, p.name: bad}, timeout=60)
        assert r.status_code != 200, p.name
        m = FIELD.search(str(r.json().get("error", r.text)))
        assert m and m.group(1) == p.name, (p.name, r.text)


def test_strings_are_not_booleans_or_numbers_anywhere(proxy, client, model) -> None:
    for name, value in (("suppress_eos", "true"), ("temperature", "0.5"), ("steps", "4")):
        keys = _keys(name, value)
        assert via_proxy(proxy.base_url, model, keys) == ("invalid", name)
        assert via_grpc(client, keys) == ("invalid", name)
        assert via_http(client, keys) == ("invalid", name)
    r = httpx.post(
        proxy.base_url + "/v1/chat/completions",
        json={"model": model, "messages": MSG, "stream": "yes"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_forwards_and_max_nfe_on_every_surface(proxy, client, model, capsys) -> None:
    keys = {"max_tokens": 16, "steps": 16, "block_length": 8, "suppress_eos": True}
    capped = {**keys, "max_nfe": 3}
    # Triton gRPC: the new outputs, streamed and final.
    chunks = list(client.stream(messages=MSG, **capped))
    final = chunks[-1]
    assert final.forwards == final.steps == 3 and final.finish_reason == "length"
    assert final.completion_tokens == 8  # the first block, committed by the capped forward
    assert final.tokens_per_forward == pytest.approx(8 / 3, abs=1e-3)
    free = client.generate(messages=MSG, **keys)
    assert free.forwards == 16 and free.tokens_per_forward == pytest.approx(1.0)
    # Triton HTTP
    http = client.generate_http(messages=MSG, **capped)
    assert (http.forwards, http.completion_tokens) == (3, 8)
    # Proxy: usage extras, summed over n choices, also in the streamed usage chunk.
    body = {"model": model, "messages": MSG, "n": 2, **capped}
    usage = httpx.post(proxy.base_url + "/v1/chat/completions", json=body, timeout=120).json()[
        "usage"
    ]
    assert usage["forwards"] == 6 and usage["completion_tokens"] == 16
    assert usage["tokens_per_forward"] == pytest.approx(16 / 6, abs=1e-3)
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", proxy.base_url + "/v1/chat/completions", json=stream_body, timeout=120
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"] == usage
    # dlm-triton generate reports them too.
    from dlm_triton.launch.cli import main

    argv = ["generate", "hi", "--url", client.url, "--model", model, "--max-tokens", "16",
            "--steps", "16", "--block-length", "8", "--max-nfe", "3", "--suppress-eos"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["forwards"], report["finish_reason"]) == (3, "length")
    assert report["tokens_per_forward"] == pytest.approx(8 / 3, abs=1e-3)
    assert main(argv) == 0
    assert "in 3 forwards" in capsys.readouterr().err
