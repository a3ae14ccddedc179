"""The playground's server side with no Triton behind it: which routes exist under which
settings, the security headers, the file allowlist, and the /v1/limits specs."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from dlm_protocol import params
from openai_proxy.app import create_app
from openai_proxy.config import ProxyConfig, config_from_args
from openai_proxy.limits import model_limits, parameter_specs
from openai_proxy.playground import STATIC_DIR


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture()
def make_client() -> Iterator:
    clients: list[TestClient] = []

    def make(**kw: object) -> TestClient:
        cfg = ProxyConfig(triton_urls=[dead_url()], health_timeout_s=0.5, **kw)
        c = TestClient(create_app(cfg), raise_server_exceptions=False, follow_redirects=False)
        clients.append(c.__enter__())
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def test_page_and_modules_are_served_with_a_strict_csp(make_client) -> None:
    client = make_client()
    root = client.get("/")
    assert root.status_code == 307 and root.headers["location"] == "playground/"
    assert client.get("/playground").headers["location"] == "playground/"
    page = client.get("/playground/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "connect-src 'self'"):
        assert directive in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert '<script type="module" src="app.js">' in page.text
    for name, kind in (("app.js", "text/javascript"), ("playground.css", "text/css")):
        resp = client.get(f"/playground/{name}")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(kind)
        assert resp.headers["content-security-policy"] == csp


def test_only_the_shipped_files_are_served(make_client) -> None:
    client = make_client()
    for path in ("/playground/nope.js", "/playground/..%2Fapp.py", "/playground/%2e%2e/config.py"):
        resp = client.get(path)
        assert resp.status_code == 404, path
        assert "error" in resp.json()


def test_page_uses_no_inline_script_no_remote_url_and_no_innerhtml() -> None:
    """What the CSP forbids anyway, checked at the source: nothing inline, nothing remote,
    and no HTML parsing of strings anywhere in the scripts."""
    sources = {p.name: p.read_text() for p in STATIC_DIR.iterdir()}
    assert {"index.html", "app.js", "api.js", "canvas.js", "playground.css"} <= set(sources)
    for name, text in sources.items():
        text = text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a name, not a fetch
        assert "http://" not in text and "https://" not in text, name
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in text, f"{name} uses {sink}"
    assert "<script>" not in sources["index.html"] and "style=" not in sources["index.html"]


def test_off_when_api_keys_are_configured_unless_enabled(make_client) -> None:
    keyed = make_client(api_keys=["k"])
    assert keyed.get("/playground/").status_code == 404
    assert keyed.get("/").status_code == 404
    assert make_client(playground="off").get("/playground/").status_code == 404
    enabled = make_client(api_keys=["k"], playground="on")
    assert enabled.get("/playground/").status_code == 200
    # The page itself is public; the API behind it still wants the key.
    assert enabled.get("/v1/limits").status_code == 401
    assert enabled.get("/v1/limits", headers={"Authorization": "Bearer k"}).status_code == 503


def test_playground_setting_from_flags_and_env() -> None:
    assert ProxyConfig().playground_enabled(has_keys=False)
    assert not ProxyConfig().playground_enabled(has_keys=True)
    cfg = config_from_args(["--playground", "on", "--api-key", "k"], environ={})
    assert cfg.playground_enabled(has_keys=True)
    cfg = config_from_args([], environ={"DLM_PROXY_PLAYGROUND": "off"})
    assert not cfg.playground_enabled(has_keys=False)
    with pytest.raises(ValueError, match="playground"):
        ProxyConfig(playground="maybe").validate()


def test_limits_follow_the_request_contract_and_the_model_config() -> None:
    specs = parameter_specs()
    assert {"max_tokens", "steps", "block_length", "algorithm", "threshold", "temperature",
            "cache", "seed"} <= set(specs)  # fmt: skip
    assert specs["algorithm"]["enum"] == list(params.BY_NAME["algorithm"].choices)
    assert specs["temperature"]["maximum"] == 2.0 and specs["temperature"]["minimum"] == 0.0
    assert specs["threshold"]["exclusiveMinimum"] == 0.0
    assert specs["cache"]["enum"] == ["none", "prefix", "dual"]
    triton_config = {"max_batch_size": 16, "parameters": {"max_canvas": {"string_value": "512"}}}
    entry = model_limits("m", triton_config, ProxyConfig(max_tokens_limit=4096))
    assert entry["max_tokens"] == 512 and entry["max_batch_rows"] == 16
    for name in ("max_tokens", "steps", "block_length"):
        assert entry["parameters"][name]["maximum"] == 512
    # The proxy's own cap wins when it is lower; the shared specs are not modified.
    assert model_limits("m", triton_config, ProxyConfig(max_tokens_limit=100))["max_tokens"] == 100
    assert "maximum" not in parameter_specs()["steps"]  # the contract sets no static maximum
