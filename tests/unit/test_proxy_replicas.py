"""The replica pool's choices and the backend's retry rule, without tritonservers.

The real-process behaviour (kills, drains, restarts) is tests/integration/test_replicas.py;
here each rule is pinned down one at a time, with a fake stream per replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from openai_proxy.config import ProxyConfig, config_from_args
from openai_proxy.converters import TritonEvent, TritonJob
from openai_proxy.errors import InternalError, InvalidRequest, ProxyError, ServiceUnavailable
from openai_proxy.replicas import (
    Outcome,
    Replica,
    ReplicaPool,
    RetryBudget,
    classify,
    resolve,
)
from openai_proxy.triton_backend import TritonBackend

MODEL = "m"


async def _noop_close(client: object) -> None:
    return None


def make_pool(urls: list[str]) -> ReplicaPool[str]:
    return ReplicaPool(urls, lambda url: f"client-{url}", _noop_close, eject_s=5.0)


def ready_pool(urls: list[str]) -> ReplicaPool[str]:
    pool = make_pool(urls)
    asyncio.run(pool.sync())
    for r in pool.replicas:
        pool.probed(r, True, {MODEL: "READY"})
    return pool


def test_pick_is_least_outstanding_and_rotates_ties() -> None:
    pool = ready_pool(["a:1", "b:1", "c:1"])
    a, b, c = pool.replicas
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert pool.pick(MODEL) is b
    assert pool.pick(MODEL, exclude={"b:1"}) is c
    a.in_flight = b.in_flight = c.in_flight = 0
    seen = {pool.pick(MODEL).url for _ in range(6)}
    assert seen == {"a:1", "b:1", "c:1"}
    assert pool.pick("other-model") is None


def test_failed_replica_is_ejected_then_back_after_its_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("openai_proxy.replicas.time.monotonic", lambda: clock[0])
    pool = ready_pool(["a:1", "b:1"])
    a, b = pool.replicas
    pool.report(a, Outcome.FAILED, "socket closed")
    assert a.failures == 1 and a.ejections == 1
    pool.probed(a, True, {MODEL: "READY"})  # a probe says ready, but the ejection holds
    assert pool.why_not_usable(a) == "ejected after a failure"
    assert [pool.pick(MODEL) for _ in range(4)] == [b] * 4
    clock[0] += 5.1
    assert a in [pool.pick(MODEL) for _ in range(4)]
    # Each failure in a row doubles the time out; a success resets the count.
    pool.report(a, Outcome.FAILED)
    assert a.ejected_until == pytest.approx(clock[0] + 10.0)
    pool.report(a, Outcome.OK)
    assert a.consecutive_failures == 0
    pool.report(a, Outcome.FAILED)
    assert a.ejected_until == pytest.approx(clock[0] + 10.0)  # still the longer one
    assert a.ejections == 2


def test_draining_replica_is_skipped_until_a_probe_finds_it_down() -> None:
    pool = ready_pool(["a:1", "b:1"])
    a, b = pool.replicas
    pool.report(a, Outcome.DRAINING, "overloaded: the server is shutting down")
    pool.probed(a, True, {MODEL: "READY"})  # still up while it drains
    assert pool.why_not_usable(a) == "draining"
    assert {pool.pick(MODEL).url for _ in range(4)} == {"b:1"}
    pool.probed(a, False, {}, "connection refused")  # it stopped
    pool.probed(a, True, {MODEL: "READY"})  # and a fresh server came up at that address
    assert {pool.pick(MODEL).url for _ in range(4)} == {"a:1", "b:1"}


def test_full_replica_is_not_ejected_but_unreachable_one_is() -> None:
    pool = ready_pool(["a:1", "b:1"])
    a, b = pool.replicas
    pool.report(a, Outcome.REFUSED, "overloaded: 64 requests in flight, try again later")
    assert a.refusals == 1 and a.usable(0) and a.ejections == 0
    pool.report(b, Outcome.REFUSED, "Triton is unavailable: failed to connect to all addresses")
    assert b.ejections == 1 and b.failures == 0 and pool.pick(MODEL) is a


def test_a_replica_whose_model_left_is_out_until_probed_again() -> None:
    """Triton's "unknown model ... has no available versions" from a replica listed READY:
    out of the pool (no failure counted) until a probe finds the model ready again."""
    pool = ready_pool(["a:1", "b:1"])
    a, b = pool.replicas
    pool.report(a, Outcome.REFUSED, "Request for unknown model: 'm' has no available versions")
    assert a.refusals == 1 and a.failures == 0 and not a.usable(0) and pool.pick(MODEL) is b


@pytest.mark.parametrize(
    ("err", "outcome"),
    [
        (ServiceUnavailable("overloaded: the server is shutting down", code="overloaded"), Outcome.DRAINING),
        (InternalError("internal error: server shutting down", code="model_error"), Outcome.DRAINING),
        (ServiceUnavailable("overloaded: 8 requests in flight", code="overloaded"), Outcome.REFUSED),
        (ServiceUnavailable("Triton is unavailable: failed to connect to all addresses", code="triton_unavailable"), Outcome.REFUSED),
        (ServiceUnavailable("Triton is unavailable: Socket closed", code="triton_unavailable"), Outcome.FAILED),
        (ServiceUnavailable("Triton closed the stream before the final response"), Outcome.FAILED),
        (InternalError("Triton error: boom", code="upstream_error"), Outcome.FAILED),
        (InvalidRequest("invalid request: steps: must be >= 1"), Outcome.OK),
        (InternalError("internal error: CUDA out of memory", code="model_error"), Outcome.OK),
        # the model left a replica that listed it READY (unloading while draining, restarting)
        (ProxyError("Request for unknown model: 'm' has no available versions", status_code=404, code="model_not_found"), Outcome.REFUSED),
    ],
)  # fmt: skip
def test_classify(err: Exception, outcome: Outcome) -> None:
    assert classify(err) is outcome


def test_retry_budget_one_failure_any_number_of_refusals() -> None:
    budget = RetryBudget(1)
    assert budget.allows_another(Outcome.REFUSED)
    assert budget.allows_another(Outcome.DRAINING)
    assert budget.allows_another(Outcome.FAILED)
    assert not budget.allows_another(Outcome.FAILED)
    assert budget.allows_another(Outcome.REFUSED)
    assert not budget.allows_another(Outcome.OK)
    assert not RetryBudget(0).allows_another(Outcome.FAILED)


def test_dns_entries_resolve_to_every_address_and_follow_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert asyncio.run(resolve("localhost:8001")) == ["localhost:8001"]
    assert "127.0.0.1:8001" in asyncio.run(resolve("dns:localhost:8001"))

    answers = {"triton-headless": ["10.0.0.1", "10.0.0.2"]}

    async def fake_getaddrinfo(self, host, port, **kw):  # noqa: ANN001 - asyncio's signature
        if host not in answers:
            raise OSError("Name or service not known")
        return [(2, 1, 6, "", (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", fake_getaddrinfo)
    pool = make_pool(["dns:triton-headless:8001", "static:8001"])

    async def scenario() -> None:
        assert await pool.sync()
        assert [r.url for r in pool.replicas] == ["10.0.0.1:8001", "10.0.0.2:8001", "static:8001"]
        first = pool.replicas[0]
        first.in_flight = 1
        answers["triton-headless"] = ["10.0.0.2", "10.0.0.3"]  # a pod replaced
        assert await pool.sync()
        assert [r.url for r in pool.replicas] == ["10.0.0.2:8001", "10.0.0.3:8001", "static:8001"]
        assert pool._retired == [first]  # closed once its last request ends
        first.in_flight = 0
        assert not await pool.sync()
        assert pool._retired == []
        del answers["triton-headless"]  # DNS hiccup: keep what we had
        assert not await pool.sync()
        assert len(pool.replicas) == 3 and pool.resolve_errors == 1

    asyncio.run(scenario())


def test_config_accepts_dns_entries_and_rejects_bad_ones() -> None:
    cfg = config_from_args(
        ["--triton-url", "dns:triton.dlm.svc:8001", "--retries", "2"], environ={}
    )
    assert cfg.triton_urls == ["dns:triton.dlm.svc:8001"] and cfg.retries == 2
    with pytest.raises(ValueError, match="HOST:PORT"):
        ProxyConfig(triton_urls=["dns:no-port"]).validate()
    with pytest.raises(ValueError, match="retries"):
        ProxyConfig(retries=-1).validate()


def test_metrics_lines_name_every_replica() -> None:
    pool = ready_pool(["a:1", "b:1"])
    pool.replicas[0].attempts = 7
    pool.report(pool.replicas[1], Outcome.DRAINING, "shutting down")
    text = "\n".join(pool.metrics_lines())
    assert 'dlm_proxy_replica_attempts_total{replica="a:1"} 7' in text
    assert 'dlm_proxy_replica_draining{replica="b:1"} 1' in text
    assert 'dlm_proxy_replica_up{replica="b:1"} 0' in text


# -- the backend's retry rule, with a scripted stream per replica ------------------------------

Script = Callable[[], AsyncIterator[TritonEvent]]


def backend_with(scripts: dict[str, Script], retries: int = 1) -> TritonBackend:
    backend = TritonBackend(ProxyConfig(triton_urls=list(scripts), retries=retries))
    backend.pool = ready_pool(list(scripts))  # type: ignore[assignment]

    async def fake_stream(st: Replica, model: str, job: TritonJob) -> AsyncIterator[TritonEvent]:
        st.attempts += 1
        st.in_flight += 1
        try:
            async for ev in scripts[st.url]():
                yield ev
        finally:
            st.in_flight -= 1

    backend.streams.open = fake_stream  # type: ignore[method-assign]
    return backend


def events(*texts: str) -> Script:
    async def gen() -> AsyncIterator[TritonEvent]:
        for t in texts:
            yield TritonEvent(text=t)
        yield TritonEvent(finish_reason="stop", final=True)

    return gen


def fails(err: Exception, after: tuple[str, ...] = ()) -> Script:
    async def gen() -> AsyncIterator[TritonEvent]:
        for t in after:
            yield TritonEvent(text=t)
        raise err

    return gen


JOB = TritonJob(
    request_id="r",
    choice_index=0,
    prompt_index=0,
    prompt_input="text_input",
    prompt_value="hi",
    stream=True,
    sampling_parameters={},
)


async def collect(backend: TritonBackend) -> str:
    return "".join([ev.text async for ev in backend.generate(MODEL, JOB)])


LOST = ServiceUnavailable("Triton is unavailable: Socket closed", code="triton_unavailable")
SHUTTING = ServiceUnavailable("overloaded: the server is shutting down", code="overloaded")


def test_failure_before_any_text_is_retried_once_elsewhere() -> None:
    backend = backend_with({"a:1": fails(LOST), "b:1": events("hello")})
    backend.pool.replicas[1].in_flight = 1  # a is picked first
    assert asyncio.run(collect(backend)) == "hello"
    a, b = backend.pool.replicas
    assert a.retried_away == 1 and a.failures == 1 and b.attempts == 1


def test_second_failure_is_not_retried_but_refusals_are_free() -> None:
    backend = backend_with({"a:1": fails(LOST), "b:1": fails(LOST), "c:1": events("x")})
    backend.pool.replicas[2].in_flight = 5  # c last
    with pytest.raises(ServiceUnavailable, match="Socket closed"):
        asyncio.run(collect(backend))
    backend = backend_with({"a:1": fails(SHUTTING), "b:1": fails(LOST), "c:1": events("x")})
    backend.pool.replicas[1].in_flight = 1
    backend.pool.replicas[2].in_flight = 2  # a, then b, then c
    assert asyncio.run(collect(backend)) == "x"
    assert backend.pool.replicas[0].draining


def test_failure_after_text_reaches_the_caller() -> None:
    backend = backend_with({"a:1": fails(LOST, after=("par",)), "b:1": events("whole")})
    backend.pool.replicas[1].in_flight = 1

    async def run() -> list[str]:
        got = []
        with pytest.raises(ServiceUnavailable):
            async for ev in backend.generate(MODEL, JOB):
                got.append(ev.text)
        return got

    assert asyncio.run(run()) == ["par"]
    assert backend.pool.replicas[1].attempts == 0


def test_request_errors_are_not_retried() -> None:
    bad = InvalidRequest("invalid request: steps: must be >= 1", code="invalid_value")
    backend = backend_with({"a:1": fails(bad), "b:1": events("x")})
    backend.pool.replicas[1].in_flight = 1
    with pytest.raises(InvalidRequest):
        asyncio.run(collect(backend))
    assert backend.pool.replicas[1].attempts == 0 and backend.pool.replicas[0].usable(0)


def test_server_abort_before_text_is_retried() -> None:
    async def aborted() -> AsyncIterator[TritonEvent]:
        yield TritonEvent(finish_reason="abort", final=True)

    backend = backend_with({"a:1": aborted, "b:1": events("ok")})
    backend.pool.replicas[1].in_flight = 1
    assert asyncio.run(collect(backend)) == "ok"


def test_proxy_metrics_endpoint_has_a_series_per_replica() -> None:
    from fastapi.testclient import TestClient

    from openai_proxy.app import create_app

    dead = "127.0.0.1:9"  # discard port: nothing answers gRPC there
    cfg = ProxyConfig(triton_urls=[dead, "dns:localhost:19"], health_timeout_s=0.5)
    with TestClient(create_app(cfg)) as client:
        text = client.get("/metrics").text
    assert f'dlm_proxy_replica_up{{replica="{dead}"}} 0' in text
    assert 'dlm_proxy_replica_attempts_total{replica="127.0.0.1:19"} 0' in text
