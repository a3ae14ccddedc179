"""Triton's admin APIs are restricted: model control, logging, trace and
shared memory need the launcher's key; inference, health and metadata stay open."""

from __future__ import annotations

import httpx
import pytest
import tritonclient.grpc as grpcclient
from reliability_stack import ExtraProxy, chat_body
from tritonclient.utils import InferenceServerException

from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

ADMIN_GETS = ["/v2/logging", "/v2/trace/setting", "/v2/systemsharedmemory/status"]


def test_admin_http_apis_need_the_key(stack: TritonServerProcess) -> None:
    base = stack.urls["http"]
    name = stack.model_name
    for path in ADMIN_GETS:
        assert httpx.get(base + path).status_code == 403, path
        assert httpx.get(base + path, headers=stack.admin_headers()).status_code == 200, path
    for path in ("/v2/repository/index", f"/v2/repository/models/{name}/unload"):
        r = httpx.post(base + path, json={})
        assert r.status_code == 403 and "restricted" in r.text.lower(), (path, r.text)
    assert httpx.post(base + "/v2/repository/index", headers=stack.admin_headers()).is_success
    # open: health, metadata, config, statistics; the model is still loaded
    for path in ("/v2/health/ready", f"/v2/models/{name}", f"/v2/models/{name}/config"):
        assert httpx.get(base + path).status_code == 200, path
    assert httpx.get(f"{base}/v2/models/{name}/stats").status_code == 200


def test_admin_grpc_apis_need_the_key(stack: TritonServerProcess) -> None:
    client = grpcclient.InferenceServerClient(stack.urls["grpc"])
    try:
        with pytest.raises(InferenceServerException, match="(?i)restricted"):
            client.unload_model(stack.model_name)
        with pytest.raises(InferenceServerException, match="(?i)restricted"):
            client.get_log_settings()
        key = stack.admin_headers("grpc")
        assert client.get_log_settings(headers=key)
        index = client.get_model_repository_index(headers=key, as_json=True)
        assert any(m["name"] == stack.model_name for m in index["models"])
        assert client.is_model_ready(stack.model_name)
    finally:
        client.close()


def test_proxy_without_the_key_falls_back_to_model_readiness(stack: TritonServerProcess) -> None:
    """A proxy given --model but no key cannot read the index; it checks the model's
    readiness instead and serves."""
    with ExtraProxy(stack, with_key=False) as proxy:
        r = httpx.post(f"{proxy.base_url}/v1/chat/completions", json=chat_body(), timeout=60)
        assert r.status_code == 200, r.text
