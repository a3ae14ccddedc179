"""Triton message -> HTTP status mapping, and settings parsing."""

from __future__ import annotations

import pytest

from openai_proxy.config import ProxyConfig, config_from_args
from openai_proxy.errors import (
    AuthenticationError,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
    UpstreamTimeout,
    from_triton_message,
)


@pytest.mark.parametrize(
    ("message", "status", "param"),
    [
        ("invalid request: block_length: must divide max_tokens (10)", 400, "block_length"),
        ("invalid request: exactly one of text_input, messages, input_ids", 400, None),
        ("[StatusCode.INTERNAL] invalid request: steps: must be >= 1", 400, "steps"),
        ("overloaded: 256 requests in flight, try again later", 503, None),
        ("internal error: RuntimeError: boom", 500, None),
        ("Request for unknown model: 'x' is not found", 404, None),
        ("failed to connect to all addresses", 503, None),
        ("Deadline Exceeded", 504, None),
        ("something odd", 500, None),
    ],
)
def test_triton_messages_map_to_statuses(message: str, status: int, param: str | None) -> None:
    err = from_triton_message(message)
    assert err.status_code == status
    assert err.param == param
    body = err.to_dict()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["message"]


def test_invalid_request_keeps_the_model_message() -> None:
    err = from_triton_message("[StatusCode.INTERNAL] invalid request: steps: must be >= 1")
    assert isinstance(err, InvalidRequest)
    assert err.message == "invalid request: steps: must be >= 1"
    assert err.error_type == "invalid_request_error"


def test_unavailable_carries_retry_after() -> None:
    err = from_triton_message("overloaded: queue full", retry_after_s=7)
    assert isinstance(err, ServiceUnavailable)
    assert err.headers == {"Retry-After": "7"}


def test_error_classes() -> None:
    assert AuthenticationError().status_code == 401
    assert AuthenticationError().headers["WWW-Authenticate"] == "Bearer"
    nf = ModelNotFound("gpt-4")
    assert nf.status_code == 404 and nf.param == "model" and "gpt-4" in nf.message
    assert UpstreamTimeout("t").status_code == 504
    assert InternalError("x").to_dict()["error"]["type"] == "server_error"


def test_config_defaults_and_env() -> None:
    cfg = ProxyConfig.from_env({})
    assert cfg.port == 9000 and cfg.triton_urls == ["localhost:8001"] and cfg.api_keys == []
    env = {
        "DLM_PROXY_TRITON_URLS": "a:8001, b:8001",
        "DLM_PROXY_API_KEYS": "k1,k2",
        "DLM_PROXY_PORT": "9100",
        "DLM_PROXY_MAX_REQUEST_BYTES": "2048",
        "DLM_PROXY_REQUEST_TIMEOUT_S": "12.5",
        "DLM_PROXY_CORS_ORIGINS": "*",
    }
    cfg = ProxyConfig.from_env(env)
    assert cfg.triton_urls == ["a:8001", "b:8001"]
    assert cfg.api_keys == ["k1", "k2"]
    assert (cfg.port, cfg.max_request_bytes, cfg.request_timeout_s) == (9100, 2048, 12.5)
    assert cfg.cors_origins == ["*"]


def test_flags_override_env() -> None:
    env = {"DLM_PROXY_TRITON_URLS": "env:8001", "DLM_PROXY_PORT": "9100"}
    argv = [
        "--triton-url", "x:1,y:2",
        "--triton-grpc", "z:3",
        "--api-key", "secret",
        "--port", "9200",
        "--model", "tiny-dlm",
        "--max-tokens-limit", "128",
    ]  # fmt: skip
    cfg = config_from_args(argv, env)
    assert cfg.triton_urls == ["x:1", "y:2", "z:3"]
    assert cfg.port == 9200 and cfg.api_keys == ["secret"] and cfg.models == ["tiny-dlm"]
    assert cfg.max_tokens_limit == 128


def test_bad_settings_fail_at_start() -> None:
    with pytest.raises(ValueError):
        ProxyConfig.from_env({"DLM_PROXY_MAX_N": "0"})
    with pytest.raises(ValueError):
        ProxyConfig.from_env({"DLM_PROXY_TRITON_URLS": " , "})
