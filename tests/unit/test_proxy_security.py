"""Safe defaults of the proxy: no open API beyond loopback, keys from a file, /health without
internals for anonymous callers, /metrics on its own port."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from dlm_triton.launch.procs import free_port, free_ports
from openai_proxy.app import create_app
from openai_proxy.config import ProxyConfig, config_from_args
from openai_proxy.security import UnsafeExposureError, check_exposure, is_loopback

ROOT = Path(__file__).resolve().parents[2]


def cfg(**kw: object) -> ProxyConfig:
    return ProxyConfig(triton_urls=[f"127.0.0.1:{free_port()}"], health_timeout_s=0.5, **kw)


@pytest.fixture()
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "api_keys"
    path.write_text("# one key per line\nkey-one\n\n  key-two  # rotated in May\n")
    return path


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.5", "proxy.internal"):
        assert not is_loopback(host), host


def test_public_address_without_keys_is_refused(key_file: Path) -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(UnsafeExposureError, match="--allow-no-auth"):
            check_exposure(cfg(host=host))
    check_exposure(cfg())  # default host: 127.0.0.1
    check_exposure(cfg(host="0.0.0.0", allow_no_auth=True))
    check_exposure(cfg(host="0.0.0.0", api_keys=["k"]))
    check_exposure(cfg(host="0.0.0.0", api_keys_file=str(key_file)))
    with pytest.raises(UnsafeExposureError, match="metrics_port"):
        check_exposure(cfg(port=9000, metrics_port=9000))


def test_an_empty_key_file_does_not_count(tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# no keys yet\n")
    with pytest.raises(UnsafeExposureError):
        check_exposure(cfg(host="0.0.0.0", api_keys_file=str(empty)))
    with pytest.raises(ValueError, match="does not exist"):
        check_exposure(cfg(host="0.0.0.0", api_keys_file=str(tmp_path / "absent")))


def test_settings_from_env_and_flags(key_file: Path) -> None:
    env = {
        "DLM_PROXY_API_KEYS_FILE": str(key_file),
        "DLM_PROXY_ALLOW_NO_AUTH": "1",
        "DLM_PROXY_METRICS_PORT": "9100",
    }
    c = config_from_args([], env)
    assert (c.api_keys_file, c.allow_no_auth, c.metrics_port) == (str(key_file), True, 9100)
    c = config_from_args(["--allow-no-auth", "--metrics-port", "9200", "--host", "::"], {})
    assert (c.allow_no_auth, c.metrics_port, c.host) == (True, 9200, "::")
    assert config_from_args([], {}).host == "127.0.0.1"


def test_the_entry_point_refuses_and_says_why() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "openai_proxy", "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "refusing to serve on 0.0.0.0" in proc.stderr and "--allow-no-auth" in proc.stderr


def test_keys_from_the_file_are_accepted(key_file: Path) -> None:
    with TestClient(create_app(cfg(api_keys_file=str(key_file)))) as c:
        assert c.get("/v1/models").status_code == 401
        for key in ("key-one", "key-two"):
            # Past auth, Triton is down here: 503, not 401.
            assert (
                c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 503
            )
        bad = c.get("/v1/models", headers={"Authorization": "Bearer # one key per line"})
        assert bad.status_code == 401


def test_health_hides_internals_from_anonymous_callers_and_tenants(key_file: Path) -> None:
    keys = {"api_keys_file": str(key_file), "admin_keys": ["ops"]}
    with TestClient(create_app(cfg(host="0.0.0.0", **keys))) as c:
        anonymous = c.get("/health")
        assert anonymous.status_code == 503 and "retry-after" in anonymous.headers
        assert anonymous.json() == {"status": "unavailable"}
        wrong = c.get("/health", headers={"Authorization": "Bearer nope"})
        assert wrong.json() == {"status": "unavailable"}
        tenant = c.get("/health", headers={"Authorization": "Bearer key-two"})
        assert tenant.json() == {"status": "unavailable"}  # no one's load, URLs or models
        operator = c.get("/health", headers={"Authorization": "Bearer ops"}).json()
        assert operator["status"] == "unavailable" and operator["triton"][0]["ready"] is False
        assert operator["in_flight"] == 0
    with TestClient(create_app(cfg(host="0.0.0.0", api_keys_file=str(key_file)))) as c:
        tenant = c.get("/health", headers={"Authorization": "Bearer key-two"})
        assert tenant.json() == {"status": "unavailable"}  # no admin key: details for nobody
    with TestClient(create_app(cfg(host="0.0.0.0", allow_no_auth=True))) as c:
        assert c.get("/health").json() == {"status": "unavailable"}  # open API, closed details
    with TestClient(create_app(cfg(host="127.0.0.1"))) as c:
        assert "triton" in c.get("/health").json()  # only this host can ask


def test_metrics_on_their_own_port(tmp_path: Path) -> None:
    api, metrics = free_ports(2)
    cmd = [
        sys.executable, "-m", "openai_proxy", "--host", "127.0.0.1", "--port", str(api),
        "--metrics-port", str(metrics), "--triton-url", f"127.0.0.1:{free_port()}",
        "--api-key", "k1", "--log-level", "warning",
    ]  # fmt: skip
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{api}/health/live").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "proxy never answered"
            time.sleep(0.2)
        scraped = httpx.get(f"http://127.0.0.1:{metrics}/metrics")  # no key on the private port
        assert scraped.status_code == 200 and "dlm_proxy_requests_total" in scraped.text
        keyed = {"Authorization": "Bearer k1"}
        assert httpx.get(f"http://127.0.0.1:{api}/metrics", headers=keyed).status_code == 404
        assert httpx.get(f"http://127.0.0.1:{metrics}/v1/models", headers=keyed).status_code == 404
        assert httpx.get(f"http://127.0.0.1:{metrics}/health").status_code == 404
        assert httpx.get(f"http://127.0.0.1:{api}/v1/models", headers=keyed).status_code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_a_call_without_a_valid_key_gets_401_whatever_its_body() -> None:
    """Auth comes first: a caller without a key learns nothing about its body (not whether it
    parses, not the size limit); with the key the same bodies get their 400 and 413."""
    json_type = {"content-type": "application/json"}
    bodies: list[tuple[bytes, dict[str, str], int]] = [
        (b"{not json", json_type, 400),
        (b"x=1", {}, 400),  # not a JSON object
        (b"", json_type, 400),  # no body
        (b'{"model": "m", "messages": [], "steps": 0}', json_type, 400),  # invalid fields
        (b'{"model": "m", "prompt": "' + b"x" * 600 + b'"}', json_type, 413),  # too large
    ]
    with TestClient(create_app(cfg(api_keys=["k1"], max_request_bytes=500))) as c:
        for path in ("/v1/chat/completions", "/v1/completions"):
            for body, headers, keyed_status in bodies:
                for auth in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}):
                    resp = c.post(path, content=body, headers={**headers, **auth})
                    assert resp.status_code == 401, (path, body[:40], auth, resp.text)
                    assert resp.json()["error"]["code"] == "invalid_api_key"
                    assert resp.headers["www-authenticate"] == "Bearer"
                keyed = c.post(
                    path, content=body, headers={**headers, "Authorization": "Bearer k1"}
                )
                assert keyed.status_code == keyed_status, (path, body[:40], keyed.text)
        for path in ("/v1/models", "/v1/models/tiny-dlm", "/v1/limits", "/v1/no-such-route"):
            assert c.get(path).status_code == 401, path
        assert c.get("/health/live").status_code == 200  # probes stay open
    # Without keys nothing changes: the body's own error.
    with TestClient(create_app(cfg())) as c:
        resp = c.post("/v1/chat/completions", content=b"{not json")
        assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]


def test_cors_preflight_needs_no_key_and_a_401_is_readable_by_the_page() -> None:
    origin = {"Origin": "http://ui.example"}
    with TestClient(create_app(cfg(api_keys=["k1"], cors_origins=["http://ui.example"]))) as c:
        preflight = c.options(
            "/v1/chat/completions",
            headers={**origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"},
        )  # fmt: skip
        assert preflight.status_code == 200
        denied = c.post("/v1/chat/completions", content=b"{not json", headers=origin)
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "http://ui.example"
