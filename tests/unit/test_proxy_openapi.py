"""The proxy's OpenAPI schema says what the proxy answers: 400 (OpenAI's error body) for a
request that fails validation, never FastAPI's 422; 404 for an unknown model; the chat roles it
accepts as an enum. Each documented answer is checked against the app's real answer too.

No Triton listens behind the app (the "Triton is down" case of test_proxy_app.py): requests that
pass validation get 503, which is documented as well.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from dlm_protocol.response import CHAT_ROLES, ROLE_ALIASES
from openai_proxy.app import create_app
from openai_proxy.config import ProxyConfig

CHAT = {"model": "tiny-dlm", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny-dlm", "prompt": "hi"}
ERROR_REF = "#/components/schemas/ErrorResponse"


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    cfg = ProxyConfig(triton_urls=[dead_url()], health_timeout_s=0.5)
    with TestClient(create_app(cfg), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def schema(client: TestClient) -> dict[str, Any]:
    resp = client.get("/openapi.json")
    assert resp.status_code == 200
    return resp.json()


def responses(schema: dict[str, Any], path: str, method: str) -> dict[str, Any]:
    return schema["paths"][path][method]["responses"]


def error_ref(response: dict[str, Any]) -> str:
    return response["content"]["application/json"]["schema"]["$ref"]


def assert_documented(schema: dict[str, Any], path: str, method: str, resp: Any) -> None:
    """The status is documented for the route, and an error body validates against its model."""
    documented = responses(schema, path, method)
    assert str(resp.status_code) in documented, (path, resp.status_code, resp.text)
    if resp.status_code >= 400:
        assert error_ref(documented[str(resp.status_code)]) == ERROR_REF
        body_schema = {"$ref": ERROR_REF, "components": schema["components"]}
        jsonschema.validate(resp.json(), body_schema)


def test_no_route_documents_422(schema: dict[str, Any]) -> None:
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            assert "422" not in operation["responses"], (path, method)
    names = schema["components"]["schemas"]
    assert "HTTPValidationError" not in names and "ValidationError" not in names


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generation_routes_document_400_with_the_openai_error_body(
    schema: dict[str, Any], path: str
) -> None:
    documented = responses(schema, path, "post")
    for status in ("400", "401", "404", "413", "503"):
        assert error_ref(documented[status]) == ERROR_REF, status
    assert "invalid" in documented["400"]["description"].lower()


def test_model_route_documents_404(schema: dict[str, Any]) -> None:
    documented = responses(schema, "/v1/models/{model_id}", "get")
    assert set(documented) == {"200", "401", "404", "503"}
    assert error_ref(documented["404"]) == ERROR_REF
    assert documented["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ModelCard")


def test_role_is_an_enum_of_the_protocol_roles(schema: dict[str, Any]) -> None:
    role = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]
    assert role["type"] == "string"
    assert set(role["enum"]) == {*CHAT_ROLES, *ROLE_ALIASES}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "steps": 0}),
        ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}),
        ("/v1/chat/completions", {"model": "m"}),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}),
        ("/v1/completions", {**COMPLETION, "prompt": [[]]}),
        ("/v1/completions", {**COMPLETION, "temperature": "hot"}),
    ],
)
def test_validation_errors_are_the_documented_400(
    client: TestClient, schema: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert_documented(schema, path, "post", resp)


def test_invalid_json_is_the_documented_400(client: TestClient, schema: dict[str, Any]) -> None:
    headers = {"content-type": "application/json"}
    resp = client.post("/v1/chat/completions", content=b"{not json", headers=headers)
    assert resp.status_code == 400
    assert_documented(schema, "/v1/chat/completions", "post", resp)


def test_every_enum_role_is_accepted(client: TestClient, schema: dict[str, Any]) -> None:
    """The schema lists no role the proxy refuses: a message of each gets past the role check
    (503 here, Triton is down; a role that needs more fields may get a 400 naming another)."""
    roles = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    for role in roles:
        messages = [{"role": role, "content": "x"}, {"role": "user", "content": "hi"}]
        resp = client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
        assert resp.status_code in (400, 503), (role, resp.text)
        assert_documented(schema, "/v1/chat/completions", "post", resp)
        if resp.status_code == 400:
            assert resp.json()["error"]["param"] != "messages.0.role", (role, resp.text)
    plain = [{"role": "user", "content": "hi"}]
    assert client.post("/v1/chat/completions", json={**CHAT, "messages": plain}).status_code == 503


def test_model_route_answers_are_documented(client: TestClient, schema: dict[str, Any]) -> None:
    resp = client.get("/v1/models/tiny-dlm")
    assert resp.status_code == 503  # no Triton ready
    assert_documented(schema, "/v1/models/{model_id}", "get", resp)
