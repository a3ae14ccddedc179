"""The proxy's request checks at the HTTP level (no Triton behind it: a valid body gets 503,
so a 400 proves the proxy refused it itself): OpenAI's own fields strictly typed, contract keys
checked by the contract with the engine's words, every key documented in the OpenAPI schema."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from fastapi.testclient import TestClient

from dlm_protocol import PARAMS
from openai_proxy.app import create_app
from openai_proxy.config import ProxyConfig

CHAT = {"model": "tiny-dlm", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = ProxyConfig(triton_urls=[dead], health_timeout_s=0.5)
    with TestClient(create_app(cfg), raise_server_exceptions=False) as c:
        yield c


def post(client: TestClient, **body: Any):
    return client.post("/v1/chat/completions", json={**CHAT, **body})


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"stream": "yes"}, "stream", "boolean"),
        ({"stream": 1}, "stream", "boolean"),
        ({"n": "2"}, "n", "integer"),
        ({"temperature": "0.5"}, "temperature", "must be a number"),
        ({"suppress_eos": "true"}, "suppress_eos", "must be true or false"),
        ({"max_nfe": 0}, "max_nfe", "must be >= 1"),
        ({"steps": 4.0}, "steps", "must be an integer"),
        ({"num_denoising_steps": "4"}, "steps", "must be an integer"),
        ({"stream_mode": "tokens"}, "stream_mode", "must be one of delta, denoise"),
    ],
)
def test_bad_types_and_values_are_400_naming_the_field(
    client: TestClient, body: dict, param: str, words: str
) -> None:
    r = post(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_conflicting_aliases_name_the_key(client: TestClient) -> None:
    r = post(client, steps=4, diffusion_steps=8)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "steps" and "conflicting values for steps" in err["message"]


CHAT_BOOLEAN = "logprobs"  # a count in the contract (completions, Triton), a boolean in chat


def test_valid_contract_values_pass_the_proxy(client: TestClient) -> None:
    for p in PARAMS:
        extra = {"stream": True} if p.name == "stream_mode" else {}
        # chat's logprobs is OpenAI's boolean; the contract's count is the completions form
        value = True if p.name == CHAT_BOOLEAN else p.examples[0]
        r = post(client, **{p.name: value}, **extra)
        assert r.status_code == 503, (p.name, r.text)  # reached the (absent) Triton


def test_openapi_documents_every_key_and_the_usage_extras(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    props = schemas["ChatCompletionRequest"]["properties"]
    for p in PARAMS:
        if p.name == CHAT_BOOLEAN:
            assert "A boolean, as OpenAI's" in props[p.name]["description"]
            continue
        assert props[p.name]["description"].startswith(p.doc.split(".")[0]), p.name
    assert props["stream"]["type"] == "boolean"
    assert {"forwards", "tokens_per_forward"} <= set(schemas["Usage"]["properties"])
