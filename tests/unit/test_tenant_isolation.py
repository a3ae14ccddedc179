"""Callers must not read each other through the prefix cache: `cache_salt` splits the page
chains (two salts never share a page, one salt does), the engine reports each request's
reused prompt tokens (`cached_tokens`, OpenAI's usage field), and the proxy salts every call
with its API key's own salt; /metrics, /health details and the API schema are not a tenant's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from dlm_engine.config import EngineConfig
from dlm_engine.engine import Engine
from dlm_engine.errors import InvalidRequestError
from dlm_engine.prefix_cache import page_hashes
from dlm_lab import testing
from dlm_triton.launch.procs import free_port
from openai_proxy import security, tenancy
from openai_proxy.app import create_app
from openai_proxy.config import ProxyConfig, config_from_args
from openai_proxy.converters import ChoiceResult, TritonJob, usage_of
from openai_proxy.routers import chat, completions

SYSTEM = "You are a careful assistant. Answer in one short line. " * 2
CASE = {"max_tokens": 8, "block_length": 4, "steps": 2}


@pytest.fixture(scope="module")
def sdar(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = testing.make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", "sdar")
    return Engine(EngineConfig(model=str(path), device="cpu"))


def fresh(like: Engine) -> Engine:
    """An engine with its own pool and prefix cache over `like`'s loaded model."""
    return Engine(EngineConfig(model=like.config.model, device="cpu"), like.loaded)


def test_two_salts_never_share_a_page_hash() -> None:
    ids = list(range(64))
    plain = page_hashes(ids, 16, 4, 4)
    a = page_hashes(ids, 16, 4, 4, "tenant-a")
    b = page_hashes(ids, 16, 4, 4, "tenant-b")
    assert a == page_hashes(ids, 16, 4, 4, "tenant-a")  # one salt: one chain
    assert len(set(plain) | set(a) | set(b)) == 12  # no page of one chain in another
    # the salt seeds the chain: the same tokens under a salt ending in them differ too
    assert page_hashes(ids, 16, 4, 4, "x") != page_hashes(ids, 16, 4, 4, "x\x00")


def test_cache_salt_is_a_validated_request_key(sdar: Engine) -> None:
    assert sdar.resolve_params({**CASE, "cache_salt": "t"}).cache_salt == "t"
    assert sdar.resolve_params(CASE).cache_salt is None
    for bad in ("", 5, ["a"], True):
        with pytest.raises(InvalidRequestError) as err:
            sdar.resolve_params({**CASE, "cache_salt": bad})
        assert err.value.field == "cache_salt"


def test_requests_share_cached_pages_only_under_the_same_salt(sdar: Engine) -> None:
    engine = fresh(sdar)
    page = engine.runner.block_pages.pool.page_tokens
    prompt = engine.encode_prompt(text=SYSTEM + "2+2?")
    whole = len(prompt) // 4 * 4 // page * page  # tokens of whole pages of whole blocks
    assert whole >= 4 * page

    def run(salt: str | None) -> Any:
        params = CASE if salt is None else {**CASE, "cache_salt": salt}
        (out,) = engine.generate([prompt], params)
        return out

    first = run("tenant-a")
    assert first.cached_tokens == 0
    other = run("tenant-b")  # a guess at A's prompt from B: no hit, nothing to learn
    unsalted = run(None)
    assert (other.cached_tokens, unsalted.cached_tokens) == (0, 0)
    assert engine.runner.prefix_cache.hit_tokens == 0
    again = run("tenant-a")
    assert again.cached_tokens == whole  # the same tenant reuses its own pages
    assert run("tenant-b").cached_tokens == whole  # and B its own, indexed by its first run
    # the salt never changes the tokens
    assert first.token_ids == other.token_ids == unsalted.token_ids == again.token_ids


def test_salted_rows_running_together_hold_their_own_pages(sdar: Engine) -> None:
    engine = fresh(sdar)
    bp = engine.runner.block_pages
    prompt = engine.encode_prompt(text=SYSTEM + "Name a color.")
    a = engine.add_request(None, prompt, {**CASE, "cache_salt": "a"})
    engine.step()  # A's prefill indexes its prompt pages
    b = engine.add_request(None, prompt, {**CASE, "cache_salt": "b"})
    a2 = engine.add_request(None, prompt, {**CASE, "cache_salt": "a"})
    engine.step()
    table = {rid: bp.rows[rid].table for rid in (a, b, a2)}
    assert not set(table[a]) & set(table[b])
    assert (
        bp.rows[a2].shared > 0 and table[a2][: bp.rows[a2].shared] == table[a][: bp.rows[a2].shared]
    )
    assert bp.rows[b].shared == 0
    finals = {o.request_id: o for o in engine.outputs() if o.finished}
    assert finals[b].cached_tokens == 0 and finals[a2].cached_tokens > 0


def test_usage_reports_cached_tokens_once_per_prompt() -> None:
    def result(index: int, prompt: int, cached: int | None) -> ChoiceResult:
        r = ChoiceResult(index, prompt, prompt_tokens=40, completion_tokens=5)
        r.cached_tokens = cached
        return r

    assert "prompt_tokens_details" not in usage_of([result(0, 0, None)])  # not reported
    assert usage_of([result(0, 0, 0)])["prompt_tokens_details"] == {"cached_tokens": 0}
    # n = 2 of one prompt: the tokens both choices reused; two prompts: summed
    usage = usage_of([result(0, 0, 32), result(1, 0, 16), result(2, 1, 32)])
    assert usage["prompt_tokens"] == 80
    assert usage["prompt_tokens_details"] == {"cached_tokens": 48}


def test_each_key_gets_its_own_salt_and_the_key_never_leaves() -> None:
    salt_a, salt_b = tenancy.tenant_salt(b"key-a", None), tenancy.tenant_salt(b"key-b", None)
    assert salt_a != salt_b and salt_a == tenancy.tenant_salt(b"key-a", None)
    assert "key-a" not in salt_a
    # a caller's own salt splits its pages further, and never reaches another key's
    mine = tenancy.tenant_salt(b"key-a", "project-1")
    assert mine not in (salt_a, tenancy.tenant_salt(b"key-b", "project-1"))
    assert salt_b != tenancy.tenant_salt(b"key-a", salt_b)  # B's salt sent by A is A's
    job = TritonJob("r", 0, 0, "text_input", "x", {"cache_salt": "project-1"}, False)
    tenancy.salt_jobs([job], None)  # no keys: the caller's salt as given
    assert job.sampling_parameters["cache_salt"] == "project-1"
    tenancy.salt_jobs([job], b"key-a")
    assert job.sampling_parameters["cache_salt"] == mine


def cfg(**kw: Any) -> ProxyConfig:
    return ProxyConfig(triton_urls=[f"127.0.0.1:{free_port()}"], health_timeout_s=0.5, **kw)


def test_the_proxy_salts_every_call_with_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """What reaches Triton: each key's calls carry that key's salt (chat and completions)."""
    sent: list[dict[str, Any]] = []

    async def record(request, state, kind, body, jobs, response_id) -> JSONResponse:
        sent.extend(j.sampling_parameters for j in jobs)
        return JSONResponse({})  # a response as it is: no Triton behind this app

    monkeypatch.setattr(chat, "serve", record)
    monkeypatch.setattr(completions, "serve", record)
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    calls = [
        ("/v1/chat/completions", chat_body),
        ("/v1/completions", {"model": "m", "prompt": "hi", "n": 2}),
        ("/v1/chat/completions", {**chat_body, "cache_salt": "p1"}),
    ]

    def salts(app_cfg: ProxyConfig, key: str) -> list[str | None]:
        sent.clear()
        with TestClient(create_app(app_cfg)) as c:
            for path, body in calls:
                auth = {"Authorization": f"Bearer {key}"}
                assert c.post(path, json=body, headers=auth).status_code == 200
        return [p.get("cache_salt") for p in sent]

    keyed = cfg(api_keys=["key-a", "key-b"])
    a, b = salts(keyed, "key-a"), salts(keyed, "key-b")
    assert a == [tenancy.tenant_salt(b"key-a", s) for s in (None, None, None, "p1")]
    assert b == [tenancy.tenant_salt(b"key-b", s) for s in (None, None, None, "p1")]
    assert salts(cfg(), "anything") == [None, None, None, "p1"]  # no keys: as given
    shared = cfg(api_keys=["key-a"], share_prefix_cache=True)
    assert salts(shared, "key-a") == [None, None, None, "p1"]


def test_a_tenant_reads_no_counters_no_details_and_no_docs(tmp_path: Path) -> None:
    admins = tmp_path / "admin_keys"
    admins.write_text("ops-key\n")
    keyed = cfg(host="0.0.0.0", api_keys=["key-b"], admin_keys_file=str(admins))
    tenant, ops = {"Authorization": "Bearer key-b"}, {"Authorization": "Bearer ops-key"}
    with TestClient(create_app(keyed)) as c:
        assert c.get("/metrics", headers=tenant).status_code == 403
        assert c.get("/metrics").status_code == 401
        assert "dlm_proxy_prompt_tokens_total" in c.get("/metrics", headers=ops).text
        assert c.get("/health", headers=tenant).json() == {"status": "unavailable"}
        assert "in_flight" in c.get("/health", headers=ops).json()
        assert c.get("/health/live").json() == {"status": "ok"}  # load balancers: no key
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert c.get(path, headers=tenant).status_code == 404, path
        assert c.get("/openapi.json").status_code == 401
        assert "cache_salt" in c.get("/openapi.json", headers=tenant).text
    with TestClient(create_app(cfg())) as c:  # no keys: the schema, still no CDN pages
        assert c.get("/openapi.json").status_code == 200
        assert c.get("/docs").status_code == 404 and c.get("/redoc").status_code == 404


def test_admin_keys_from_flags_env_and_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "admin_keys"
    keys.write_text("# operators\nops-1\nops-2  # rotated\n")
    env = {"DLM_PROXY_ADMIN_KEYS_FILE": str(keys), "DLM_PROXY_SHARE_PREFIX_CACHE": "1"}
    c = config_from_args(["--admin-key", "ops-3"], env)
    assert (c.admin_keys, c.share_prefix_cache) == (["ops-3"], True)
    assert security.admin_keys(c) == [b"ops-3", b"ops-1", b"ops-2"]
    assert config_from_args(["--share-prefix-cache"], {}).share_prefix_cache
    assert not config_from_args([], {}).share_prefix_cache  # per key by default
    with pytest.raises(ValueError, match="does not exist"):  # refused at start, not per request
        security.check_exposure(cfg(admin_keys_file=str(tmp_path / "absent")))
