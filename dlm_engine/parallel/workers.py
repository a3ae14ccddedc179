"""Worker ranks 1..N-1: rank 0 starts those of its host, watches them and stops them; each
loads its shard and runs rank 0's commands until told to stop or until rank 0 is gone. With
`tensor_parallel_nodes` > 1 the ranks of every other host are started there by a node process
(`node.py`) with the same `WorkerSet`; rank 0 waits for them through its store.

A worker dies with rank 0: it asks the kernel for SIGKILL when its parent thread ends
(`PR_SET_PDEATHSIG`), and the workers are started from a keeper thread that lives until
`WorkerSet.stop()`, so that thread is the process's own lifetime, not that of whichever
thread built the engine. Rank 0 stops them on every exit path (`stop()`, the engine's
finalizer at exit) by their PIDs: a stop command, then SIGKILL after a grace period, then a
wait that reaps them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0
# rank 0's store keys besides the channel's: the spec a node reads, a node's arrival, why a
# node's rank is gone, and the group's stop
SPEC_KEY = "spec"
NODE_KEY = "node/{}"
LOST_KEY = "lost"
STOP_KEY = "stop"


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


class WorkerSet:
    """The worker processes this process starts (rank 0: ranks 1.. of its host; a node
    process: its host's ranks, with `leader` False), and rank 0's waits for all N-1 ranks."""

    def __init__(
        self,
        spec: dict[str, Any],
        world: int,
        store,
        ranks: Sequence[int] | None = None,
        leader: bool = True,
    ) -> None:
        self.world = world
        self.nodes = int(spec.get("nodes", 1))
        self.per_node = world // self.nodes
        self.ranks = list(range(1, self.per_node) if ranks is None else ranks)
        self.leader = leader
        self.store = store
        self.procs: list[subprocess.Popen] = []
        self.stopped = False
        self._quit = threading.Event()
        self._up = threading.Event()
        self._error: BaseException | None = None
        self._keeper = threading.Thread(
            target=self._keep, args=(spec,), name="tp-workers", daemon=True
        )
        self._keeper.start()
        self._up.wait()
        # a node process never sets the group's stop: it stops its own workers by signal
        self._finalizer = weakref.finalize(
            self, _shut_down, self.procs, self.store if leader else None
        )
        if self._error is not None:
            self.stop()
            raise self._error

    def _keep(self, spec: dict[str, Any]) -> None:
        """The workers' parent thread: start them, then live until `stop()`."""
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}  # idle store polls warn otherwise
        try:
            for rank in self.ranks:
                local = {"rank": rank, "local_rank": rank % self.per_node, "parent": os.getpid()}
                args = json.dumps({**spec, **local})
                cmd = [_python(), "-m", "dlm_engine.parallel.worker_main", args]
                self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's thread
            self._error = exc
        finally:
            self._up.set()
        self._quit.wait()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self, grace_s: float = 0.0) -> None:
        """Raise a clear error if any worker has exited (or the set was stopped). With
        `grace_s`, look again until then: after a failed collective, a killed worker's exit
        can trail the transport's error ("connection reset") by a moment, and the rank that
        died is the clearer cause to report."""
        from .model import TensorParallelError

        deadline = time.monotonic() + grace_s
        while (fault := self.fault()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if fault is not None:
            raise TensorParallelError(fault)

    def fault(self) -> str | None:
        """Why this group cannot run a forward any more (stopped, a worker exited, a node's
        rank lost), as text; None while every rank runs."""
        if self.stopped:
            return "the tensor-parallel workers were stopped"
        gone = self.gone()
        if gone is not None:
            return (
                f"{gone}; this engine (tensor_parallel_size {self.world}) cannot run a forward "
                "until it is restarted"
            )
        if self.leader and self.nodes > 1 and self.store.check([LOST_KEY]):
            return (
                f"{self.store.get(LOST_KEY).decode()}; this engine (tensor_parallel_size "
                f"{self.world} over {self.nodes} nodes) cannot run a forward until it is restarted"
            )
        return None

    def gone(self) -> str | None:
        """Which of the workers started here has exited, as text; None while all run."""
        for rank, p in zip(self.ranks, self.procs, strict=False):
            rc = p.poll()
            if rc is not None:
                return (
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with {_describe(rc)}"
                )
        return None

    def node_ranks(self, node: int) -> str:
        """Node `node`'s ranks, as text."""
        return f"ranks {node * self.per_node}..{(node + 1) * self.per_node - 1}"

    def wait_nodes(self, timeout_s: float) -> None:
        """Wait until the node process of every other host has joined rank 0's store; a node
        missing after `timeout_s` is an error naming it."""
        deadline = time.monotonic() + timeout_s
        for node in range(1, self.nodes):
            while not self.store.check([NODE_KEY.format(node)]):
                self.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"tensor-parallel node {node} of {self.nodes} ({self.node_ranks(node)}) "
                        f"did not join within {timeout_s:g} s: run `dlm-triton tp-node --leader "
                        f"<this host>:{self.store.port} --node {node}` on that host, and let it "
                        f"reach port {self.store.port} here"
                    )
                time.sleep(0.05)

    def wait_joining(self, timeout_s: float) -> None:
        """Wait until every worker is about to join the process group, so that rank 0's own
        join (which waits for all ranks) never waits for a worker that died before it."""
        self.wait_ready(timeout_s, "joining")

    def wait_ready(self, timeout_s: float, what: str = "ready") -> None:
        """Wait until every worker has loaded its shard; a worker that failed or died says
        so at once."""
        deadline = time.monotonic() + timeout_s
        for rank in range(1, self.world):
            key = f"{what}/{rank}"
            while not self.store.check([key]):
                self.check()
                if time.monotonic() > deadline:
                    node = rank // self.per_node
                    where = f" (on tensor-parallel node {node})" if node else ""
                    raise TimeoutError(f"worker rank {rank}{where} not {what} after {timeout_s} s")
                time.sleep(0.05)
            status = self.store.get(key).decode()
            if status != "ok":
                raise RuntimeError(f"tensor-parallel worker rank {rank}: {status}")

    def stop(self) -> None:
        """Stop and reap every worker (idempotent), then leave the process group."""
        if self.stopped:
            return
        self.stopped = True
        self._finalizer()
        self._quit.set()


def _shut_down(procs: list[subprocess.Popen], store) -> None:
    """Stop and reap the workers, then leave the process group (also when the set is
    dropped without `stop()`, e.g. an engine that failed to start, or at exit); without a
    `store` (a node process) the workers are stopped by SIGTERM instead of the group's stop."""
    from .group import leave_group

    _stop_procs(procs, store)
    leave_group()


def _stop_procs(procs: list[subprocess.Popen], store) -> None:
    """Ask the workers to stop (the group's stop key, or SIGTERM without a store), then
    SIGKILL whoever is left after the grace period; reap all."""
    if store is None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    with contextlib.suppress(Exception):  # the store may be gone; the kill below still works
        if store is not None:
            store.set(STOP_KEY, "1")
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _python() -> str:
    """This environment's interpreter: `sys.executable`, unless this process is an embedding
    host (Triton's Python backend stub), then the environment's own `bin/python3`."""
    exe = Path(sys.executable)
    if exe.name.startswith("python"):
        return str(exe)
    return str(Path(sys.prefix) / "bin" / "python3")


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent goes (Linux); exit now if it already went."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def worker_main(spec: dict[str, Any]) -> int:
    """A worker rank: join the group, load this rank's shard, run commands until told to stop."""
    from .channel import Channel
    from .group import init_group, join_store, rank_device
    from .model import WorkerModel
    from .start import load_rank

    parent, rank, world = int(spec["parent"]), int(spec["rank"]), int(spec["world"])
    _die_with_parent(parent)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    store = join_store(int(spec["port"]), world, float(spec["timeout_s"]), spec["host"])
    store.set(f"joining/{rank}", "ok")
    device = rank_device(spec["device"], int(spec["local_rank"]))
    if device.type == "cuda" and spec.get("fused_kernels"):  # as rank 0's ModelRunner does
        from ..models.common import FusedKernels

        FusedKernels.enabled = True
    from ..models.expert_gemm import ExpertGemm

    ExpertGemm.set_mode(spec.get("expert_gemm", "aten"))
    init_group(store, rank, world, device, float(spec["timeout_s"]))
    try:
        loaded = load_rank(spec, rank, world)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        store.set(f"ready/{rank}", f"error: {type(exc).__name__}: {exc}")
        return 1
    if loaded.family.uniform_diffusion:  # DiffusionGemma under expert parallel
        from .gemma import GemmaWorker

        worker: WorkerModel | GemmaWorker = GemmaWorker(loaded.model, device)
    else:
        worker = WorkerModel(loaded.model, device)
    store.set(f"ready/{rank}", "ok")
    channel = Channel(store)

    def alive() -> bool:
        try:
            return os.getppid() == parent and not store.check([STOP_KEY])
        except Exception:  # noqa: BLE001 - rank 0's store is gone with rank 0
            return False

    while True:
        got = channel.receive(device, alive)
        if got is None:
            break
        worker.run(*got)
    return 0
