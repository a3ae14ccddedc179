"""Two tenants (API keys A and B) on one proxy in front of a block-diffusion model with its
prefix cache on: B cannot learn A's prompt, neither from cache hits (`cached_tokens`, the
engine's hit counter), nor from the proxy's /metrics or /health, nor from API docs pages.

Without isolation B confirms a guess: the right guess of A's prompt reuses A's cached pages
(`cached_tokens` > 0, the hit counter moves), a wrong one does not. With it every guess of B
reads 0, while A still reuses its own pages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from reliability_stack import MODEL, ExtraProxy, metric_value, require_triton, start_stack

from dlm_lab.testing import make_tiny_checkpoint
from dlm_triton.launch.launcher import TritonServerProcess

pytestmark = pytest.mark.integration

KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "operator-key"
SECRET = "Internal memo for the board: the merger code word is HERON-7741; tell no one. "
WRONG = "Internal memo for the board: the merger code word is EAGLE-1234; tell no one. "
HITS = "dlm_prefix_cache_hit_tokens_total"


@pytest.fixture(scope="module")
def sdar_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServerProcess]:
    require_triton()
    root = tmp_path_factory.mktemp("tenants")
    checkpoint = make_tiny_checkpoint(root / "ckpt", "sdar", seed=3)
    pool = {"kv_cache_tokens": "4096", "prefix_cache_tokens": "2048"}
    server = start_stack(checkpoint, root, engine_params=pool)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def proxy(
    sdar_stack: TritonServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ExtraProxy]:
    admin_file = tmp_path_factory.mktemp("keys") / "admin_keys"
    admin_file.write_text(ADMIN + "\n")
    keys = ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-keys-file", str(admin_file)]
    with ExtraProxy(sdar_stack, *keys) as p:
        yield p


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cached_tokens(proxy: ExtraProxy, key: str, prompt: str, **extra: object) -> int:
    """One completion of `prompt` as `key`; the prompt tokens it reused from the cache."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra}
    r = httpx.post(f"{proxy.base_url}/v1/completions", json=body, headers=auth(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def settled_hits(server: TritonServerProcess, want: float, timeout_s: float = 15.0) -> float:
    """The engine's hit counter once it reads `want` (its sender thread records it a moment
    after the answer), or its value at the deadline."""
    deadline = time.monotonic() + timeout_s
    value = metric_value(server, HITS)
    while value != want and time.monotonic() < deadline:
        time.sleep(0.2)
        value = metric_value(server, HITS)
    return value


def test_b_cannot_confirm_a_guess_of_a_prompt_by_cache_hits(
    proxy: ExtraProxy, sdar_stack: TritonServerProcess
) -> None:
    assert cached_tokens(proxy, KEY_A, SECRET) == 0  # A's prompt, now cached
    own = cached_tokens(proxy, KEY_A, SECRET)
    assert own >= 48, "A reuses its own cached prompt pages"
    hits = settled_hits(sdar_stack, own)
    assert hits == own
    # B's guesses. Shared, the wrong one would read the pages it has in common with A's
    # prompt and the right one all of A's; kept per key, each reads only what B itself sent
    # before: nothing for the first, the common pages (B's own) for the second.
    wrong = cached_tokens(proxy, KEY_B, WRONG)
    right = cached_tokens(proxy, KEY_B, SECRET)
    assert wrong == 0
    assert 0 < right < own
    assert cached_tokens(proxy, KEY_B, SECRET, cache_salt="guess") == 0  # no salt reaches A's
    # the engine's counter moved by B's own hits alone
    assert settled_hits(sdar_stack, hits + right) == hits + right
    # a cache_salt splits one key's pages further
    assert cached_tokens(proxy, KEY_A, SECRET, cache_salt="project-2") == 0
    assert cached_tokens(proxy, KEY_A, SECRET) == own


def test_b_reads_no_counters_load_or_models(proxy: ExtraProxy) -> None:
    base = proxy.base_url
    cached_tokens(proxy, KEY_A, SECRET)  # A's traffic the counters would show
    metrics = httpx.get(f"{base}/metrics", headers=auth(KEY_B))
    assert metrics.status_code == 403 and "dlm_proxy" not in metrics.text
    assert httpx.get(f"{base}/metrics").status_code == 401
    operator = httpx.get(f"{base}/metrics", headers=auth(ADMIN))
    assert operator.status_code == 200 and "dlm_proxy_prompt_tokens_total" in operator.text
    for headers in ({}, auth(KEY_B)):
        health = httpx.get(f"{base}/health", headers=headers)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    details = httpx.get(f"{base}/health", headers=auth(ADMIN)).json()
    assert {"in_flight", "triton", "models"} <= set(details)
    assert httpx.get(f"{base}/health/live").json() == {"status": "ok"}


def test_no_docs_pages_and_the_schema_for_key_holders_only(proxy: ExtraProxy) -> None:
    base = proxy.base_url
    for path in ("/docs", "/redoc"):
        page = httpx.get(base + path, headers=auth(KEY_B))
        assert page.status_code == 404 and "cdn" not in page.text.lower(), path
    assert httpx.get(f"{base}/openapi.json").status_code == 401
    schema = httpx.get(f"{base}/openapi.json", headers=auth(KEY_B))
    assert schema.status_code == 200 and "cache_salt" in schema.text


def test_admin_keys_are_not_api_keys(proxy: ExtraProxy, tmp_path: Path) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    r = httpx.post(f"{proxy.base_url}/v1/completions", json=body, headers=auth(ADMIN))
    assert r.status_code == 401
