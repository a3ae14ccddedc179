"""One host's share of a tensor-parallel group that spans several (`tensor_parallel_nodes`):
a node process joins rank 0's store at the leader's address, reads the spec rank 0 published
there, resolves the checkpoint on this host, and starts this host's ranks as local worker
processes (the `WorkerSet` rank 0 uses for its own host). It watches them until rank 0 says
stop or its store is gone, then stops them by PID and exits.

A rank of this host that exits is reported to rank 0 through the store (`LOST_KEY`), so rank
0's next forward fails naming it; a forward already waiting on it fails at the collective
timeout. A node process that dies takes its workers with it (they die with their parent).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from typing import Any

import torch

from dlm_protocol import settings

from .group import join_store
from .workers import LOST_KEY, NODE_KEY, SPEC_KEY, STOP_GRACE_S, STOP_KEY, WorkerSet

log = logging.getLogger(__name__)

DEFAULT_PORT = int(settings.BY_NAME["tensor_parallel_port"].default)
WAIT_S = 3600.0  # how long a node waits for rank 0's store (rank 0 may be downloading)
POLL_S = 0.5


def parse_leader(leader: str, port: int = DEFAULT_PORT) -> tuple[str, int]:
    """`HOST` or `HOST:PORT` (`[v6]:PORT` for an IPv6 address) as (host, port)."""
    host, sep, tail = leader.rpartition(":")
    if not sep or (host.count(":") and not host.endswith("]")):
        host, tail = leader, ""  # no port, or a bare IPv6 address
    host = host.strip("[]")
    if tail:
        if not tail.isdigit() or not 1 <= int(tail) <= 65535:
            raise ValueError(f"--leader {leader!r}: the port must be in [1, 65535]")
        port = int(tail)
    if not host:
        raise ValueError(f"--leader {leader!r} names no host")
    return host, port


def wait_listening(host: str, port: int, wait_s: float) -> None:
    """Wait until `host:port` accepts connections (rank 0 may still be downloading, its pod's
    name may not resolve yet), saying so once a minute; torch's own store client would log a
    stack trace on every retry."""
    deadline = time.monotonic() + wait_s
    note = 0.0
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as exc:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"rank 0's store at {host}:{port} did not answer within {wait_s:g} s ({exc})"
                ) from None
            if now >= note:
                log.warning("waiting for rank 0's store at %s:%d (%s)", host, port, exc)
                note = now + 60.0
            time.sleep(1.0)


def node_spec(spec: dict[str, Any], host: str) -> dict[str, Any]:
    """Rank 0's spec as this host's workers need it: rank 0's address, this host's own
    checkpoint folder and devices (its first GPU for its first rank)."""
    from ..hub import resolve_checkpoint

    path = resolve_checkpoint(spec["model"], spec.get("revision"))
    device = torch.device(spec["device"])
    local = "cuda:0" if device.type == "cuda" else device.type
    return {**spec, "path": str(path), "host": host, "device": local}


def run_node(host: str, port: int, node: int, wait_s: float = WAIT_S) -> int:
    """Serve node `node` of rank 0's group at `host:port` until the group stops; 0 when rank 0
    stopped it, 1 when rank 0 or one of this host's ranks went away."""
    wait_listening(host, port, wait_s)
    store = join_store(port, None, wait_s, host)
    spec = json.loads(store.get(SPEC_KEY))  # published by rank 0 before it starts any rank
    world, nodes = int(spec["world"]), int(spec.get("nodes", 1))
    if not 1 <= node < nodes:  # told here only: rank 0 waits for the right node
        raise ValueError(
            f"--node {node}: rank 0 runs tensor_parallel_nodes {nodes}, so the other nodes "
            f"are 1..{nodes - 1}"
        )
    try:
        local = node_spec(spec, host)
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it and stops waiting
        store.set(LOST_KEY, f"tensor-parallel node {node}: {type(exc).__name__}: {exc}")
        raise
    per_node = world // nodes
    store.set(NODE_KEY.format(node), "ok")
    ranks = range(node * per_node, (node + 1) * per_node)
    log.warning("tensor-parallel node %d: ranks %d..%d of %d", node, ranks[0], ranks[-1], world)
    workers = WorkerSet(local, world, store, ranks=ranks, leader=False)
    try:
        return _watch(workers, store, node)
    finally:
        workers.stop()


def _watch(workers: WorkerSet, store, node: int) -> int:
    """Wait for the group's stop (0), rank 0's store gone or a rank of this host gone (1)."""
    while True:
        gone = workers.gone()
        if gone is not None:
            if _stopping(store):
                return 0  # they saw the stop first
            message = f"tensor-parallel node {node}: {gone}"
            log.error("%s", message)
            with contextlib.suppress(Exception):  # rank 0's store may be gone as well
                store.set(LOST_KEY, message)
            return 1
        stopping = _stopping(store)
        if stopping is not False:
            _let_exit(workers)  # the workers see the same stop, or rank 0 gone
            return 0 if stopping else 1
        time.sleep(POLL_S)


def _stopping(store) -> bool | None:
    """True once rank 0 says stop, None once its store is gone, else False."""
    try:
        return bool(store.check([STOP_KEY]))
    except Exception:  # noqa: BLE001 - rank 0's store is gone with rank 0
        return None


def _let_exit(workers: WorkerSet) -> None:
    """Give the workers the grace period to end by themselves before they are stopped."""
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in workers.procs):
        time.sleep(0.05)
