"""The set of Triton replicas behind the proxy: who they are, which one gets the next request,
what to do when one fails, and their per-replica counters.

Why least-outstanding-requests and not round robin: one DLM request can cost ten times another
(canvas length x steps), so equal request counts are not equal load; the replica with the fewest
requests open is the best cheap guess of the one that will finish soonest.

Replicas come from a static list of `host:port` gRPC addresses, or from `dns:HOST:PORT`
entries (a Kubernetes headless Service) that are re-resolved every `resolve_interval_s`: each
address the name resolves to is one replica, pods that leave the Service leave the pool.

This module knows nothing about gRPC or tensors: the caller gives a `make_client` factory and
reports each attempt's outcome; the pool keeps the state and decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .errors import InternalError, ProxyError, ServiceUnavailable

log = logging.getLogger("openai_proxy.replicas")

C = TypeVar("C")

DNS_PREFIX = "dns:"
# Gaps between a failed replica's reconnect attempts grow to this cap (seconds).
MAX_EJECT_S = 30.0
# Markers of an attempt the replica never accepted: moving on costs the request nothing.
_REFUSAL_MARKERS = ("failed to connect", "connection refused", "connect failed", "dns resolution")
_SHUTDOWN_MARKERS = ("shutting down", "server is stopping", "draining")
# Triton's answer for a model it is unloading or has not loaded yet ("Request for unknown model:
# 'x' has no available versions"): a replica is only picked while its probe lists the model
# READY, so this means the model left it (a draining or restarting server) since that probe.
_MODEL_GONE_MARKERS = ("no available versions", "unknown model")


class Outcome(enum.Enum):
    """What one attempt on one replica taught us about the replica."""

    OK = "ok"  # it answered (success, or an error about the request itself)
    REFUSED = "refused"  # it turned the request away without doing work (full, unreachable)
    DRAINING = "draining"  # it is shutting down: no new requests until it restarts
    FAILED = "failed"  # it broke while serving: connection lost, stream cut, aborted


@dataclass
class Replica(Generic[C]):
    """One tritonserver: its client, what the last health probe found, and its counters."""

    url: str
    client: C
    source: str = ""  # the configured entry it came from (the `dns:` name, or the url itself)
    ready: bool = False
    models: set[str] = field(default_factory=set)
    # Every model in the repository index with its state (READY, LOADING, UNAVAILABLE, ...).
    states: dict[str, str] = field(default_factory=dict)
    last_error: str = ""
    last_probe: float = 0.0
    in_flight: int = 0
    # Set when the replica said it is shutting down; cleared when a probe finds it down (it
    # restarted or left) so that a drained-and-restarted server is used again.
    draining: bool = False
    # Not picked before this monotonic time (after a failure), even if a probe says ready.
    ejected_until: float = 0.0
    consecutive_failures: int = 0
    # Counters for /metrics.
    attempts: int = 0
    failures: int = 0
    refusals: int = 0
    retried_away: int = 0
    ejections: int = 0

    def usable(self, now: float) -> bool:
        return self.ready and not self.draining and now >= self.ejected_until


def classify(err: BaseException) -> Outcome:
    """Which `Outcome` an error from a replica means (requests' own errors are OK)."""
    if not isinstance(err, ProxyError):
        return Outcome.FAILED
    text = err.message.lower()
    if any(m in text for m in _SHUTDOWN_MARKERS):
        return Outcome.DRAINING
    if isinstance(err, ServiceUnavailable):
        if err.code == "overloaded" or any(m in text for m in _REFUSAL_MARKERS):
            return Outcome.REFUSED
        return Outcome.FAILED
    if isinstance(err, InternalError) and err.code == "upstream_error":
        return Outcome.FAILED  # an unrecognised gRPC failure, not the model's own message
    if err.code == "model_not_found" and any(m in text for m in _MODEL_GONE_MARKERS):
        return Outcome.REFUSED  # no work done: the request moves on to a replica that has it
    return Outcome.OK


class RetryBudget:
    """One request's attempts: a replica that refused costs nothing, a failure uses the one retry.

    `retries` is how many attempts may follow a failure of a replica that had accepted the
    request (it may have spent GPU time on it); refusals (full, draining, unreachable) only
    move the request on. No replica is tried twice.
    """

    def __init__(self, retries: int) -> None:
        self.retries_left = retries
        self.tried: set[str] = set()

    def allows_another(self, outcome: Outcome) -> bool:
        if outcome is Outcome.OK:
            return False
        if outcome is Outcome.FAILED:
            if self.retries_left <= 0:
                return False
            self.retries_left -= 1
        return True


def _split_host_port(entry: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"Triton address must be HOST:PORT, got {entry!r}")
    return host.strip("[]"), int(port)


def validate_targets(targets: Sequence[str]) -> None:
    """Fail at start-up on entries that cannot work (`dns:` entries need HOST:PORT)."""
    for t in targets:
        if t.startswith(DNS_PREFIX):
            _split_host_port(t[len(DNS_PREFIX) :])


async def resolve(entry: str) -> list[str]:
    """`dns:HOST:PORT` -> every `ip:port` HOST resolves to now (sorted); others unchanged."""
    if not entry.startswith(DNS_PREFIX):
        return [entry]
    host, port = _split_host_port(entry[len(DNS_PREFIX) :])
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addrs = {info[4][0] for info in infos}
    return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addrs)


class ReplicaPool(Generic[C]):
    """The current replicas and the choice among them.

    `pick` is least-outstanding-requests among usable replicas serving the model (ties rotate);
    `report` updates a replica from an attempt's outcome; `sync` re-resolves `dns:` entries.
    """

    def __init__(
        self,
        targets: Sequence[str],
        make_client: Callable[[str], C],
        close_client: Callable[[C], Awaitable[Any]],
        eject_s: float = 1.0,
    ) -> None:
        validate_targets(targets)
        self.targets = list(targets)
        self._make_client = make_client
        self._close_client = close_client
        self.eject_s = eject_s
        self.replicas: list[Replica[C]] = []
        self._rotation = itertools.count()
        self._retired: list[Replica[C]] = []
        self.resolve_errors = 0

    # -- membership ----------------------------------------------------------------------------

    async def sync(self) -> bool:
        """Bring the replica list up to date with the targets; True if it changed.

        A name that fails to resolve keeps its previous replicas (a DNS hiccup must not empty
        the pool); replicas that left are closed once their last request ends.
        """
        wanted: dict[str, str] = {}
        known = {r.url: r for r in self.replicas}
        for entry in self.targets:
            try:
                urls = await resolve(entry)
            except OSError as exc:
                self.resolve_errors += 1
                log.warning("cannot resolve %s: %s", entry, exc)
                urls = [r.url for r in self.replicas if r.source == entry]
            for url in urls:
                wanted.setdefault(url, entry)
        if list(wanted) == [r.url for r in self.replicas]:
            await self._close_retired()
            return False
        kept = []
        for url, entry in wanted.items():
            replica = known.pop(url, None)
            if replica is None:
                replica = Replica(url=url, client=self._make_client(url), source=entry)
                log.info("replica %s joined (%s)", url, entry)
            kept.append(replica)
        for gone in known.values():
            log.info("replica %s left", gone.url)
            self._retired.append(gone)
        self.replicas = kept
        await self._close_retired()
        return True

    async def _close_retired(self) -> None:
        still = []
        for r in self._retired:
            if r.in_flight > 0:
                still.append(r)
                continue
            with contextlib.suppress(Exception):
                await self._close_client(r.client)
        self._retired = still

    async def close(self) -> None:
        for r in [*self.replicas, *self._retired]:
            with contextlib.suppress(Exception):
                await self._close_client(r.client)
        self.replicas, self._retired = [], []

    # -- health --------------------------------------------------------------------------------

    def probed(
        self, replica: Replica[C], ready: bool, states: dict[str, str], error: str = ""
    ) -> None:
        """Record a health probe. A replica found down is no longer `draining`: whatever
        comes up at that address next is a fresh server."""
        was = replica.usable(time.monotonic())
        replica.ready = ready
        replica.states = states
        replica.models = {name for name, state in states.items() if state == "READY"}
        replica.last_error = error
        replica.last_probe = time.monotonic()
        if not ready:
            replica.draining = False
        now_usable = replica.usable(time.monotonic())
        if was != now_usable:
            log.log(
                logging.INFO if now_usable else logging.WARNING,
                "triton %s is now %s%s",
                replica.url,
                "in use" if now_usable else "NOT in use",
                f" ({error})" if error else "",
            )

    def why_not_usable(self, replica: Replica[C]) -> str:
        """For 503 messages and /health: what keeps the replica out now."""
        if replica.draining:
            return "draining"
        if replica.last_error:
            return replica.last_error
        if time.monotonic() < replica.ejected_until:
            return "ejected after a failure"
        return "ready" if replica.ready else "not ready"

    # -- choice --------------------------------------------------------------------------------

    def candidates(self, model: str) -> list[Replica[C]]:
        now = time.monotonic()
        return [r for r in self.replicas if r.usable(now) and model in r.models]

    def pick(self, model: str, exclude: Iterable[str] = ()) -> Replica[C] | None:
        """The usable replica serving `model` with the fewest requests open (ties rotate)."""
        skip = set(exclude)
        cands = [r for r in self.candidates(model) if r.url not in skip]
        if not cands:
            return None
        low = min(r.in_flight for r in cands)
        ties = [r for r in cands if r.in_flight == low]
        return ties[next(self._rotation) % len(ties)]

    def report(self, replica: Replica[C], outcome: Outcome, reason: str = "") -> None:
        """Update a replica from one attempt: a failure ejects it for a while (1x, 2x, 4x ...
        `eject_s` for each ejection without a success in between; the failures of one outage
        count once), a shutdown notice takes it out until it restarts."""
        if outcome is Outcome.OK:
            replica.consecutive_failures = 0
            return
        if outcome is Outcome.REFUSED:
            replica.refusals += 1
            if not any(m in reason.lower() for m in (*_REFUSAL_MARKERS, *_MODEL_GONE_MARKERS)):
                return  # full, not broken: it stays in the pool
        if outcome is Outcome.DRAINING:
            if not replica.draining:
                log.warning("triton %s is draining: no new requests until it restarts", replica.url)
            replica.draining = True
            return
        replica.failures += outcome is Outcome.FAILED
        now = time.monotonic()
        if now < replica.ejected_until:
            return  # already out: failures of the same outage (its other streams) count once
        replica.consecutive_failures += 1
        backoff = min(MAX_EJECT_S, self.eject_s * 2 ** (replica.consecutive_failures - 1))
        replica.ejected_until = now + backoff
        replica.ejections += 1
        log.warning(
            "triton %s ejected for %.1fs: %s", replica.url, backoff, reason or outcome.value
        )
        replica.ready = False  # the next probe decides when it is back

    # -- metrics -------------------------------------------------------------------------------

    def metrics_lines(self) -> list[str]:
        """Per-replica series in Prometheus text format, label `replica` = its address."""
        now = time.monotonic()
        families: list[tuple[str, str, str, Callable[[Replica[C]], float]]] = [
            ("dlm_proxy_replica_up", "gauge", "1 if the replica gets new requests now", lambda r: int(r.usable(now))),
            ("dlm_proxy_replica_draining", "gauge", "1 while the replica is shutting down", lambda r: int(r.draining)),
            ("dlm_proxy_replica_in_flight", "gauge", "Triton streams open on the replica", lambda r: r.in_flight),
            ("dlm_proxy_replica_attempts_total", "counter", "Triton streams opened on the replica", lambda r: r.attempts),
            ("dlm_proxy_replica_failures_total", "counter", "Streams that broke on the replica (lost, cut, aborted)", lambda r: r.failures),
            ("dlm_proxy_replica_refusals_total", "counter", "Requests the replica turned away (full, draining, unreachable)", lambda r: r.refusals),
            ("dlm_proxy_replica_retries_total", "counter", "Requests moved from this replica to another before any token was sent", lambda r: r.retried_away),
            ("dlm_proxy_replica_ejections_total", "counter", "Times the replica was taken out after a failure", lambda r: r.ejections),
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, help_text, value in families:
            lines += [f"# HELP {name} {help_text}.", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{replica="{r.url}"}} {value(r)}' for r in self.replicas]
        return lines
