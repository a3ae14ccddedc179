"""The ranks' process group: a TCP store hosted by rank 0, then torch.distributed's default
group over it (gloo on CPU, NCCL on CUDA) with a timeout on every collective, so a rank that
stops answering turns into an error instead of a hang."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

LOCALHOST = "127.0.0.1"  # how the ranks on rank 0's host reach its store


# How long a stop waits for the process group's teardown (see leave_group).
LEAVE_TIMEOUT_S = 10.0


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the engine's own (`cuda:k` -> `cuda:k+r`) when the
    engine runs on CUDA, else the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def host_store(world: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Rank 0's store on `port` (0: a free one; `.port` tells the workers). torch's store
    server listens on every interface, which the ranks of other hosts need; its clients
    (this process included) connect by address."""
    return dist.TCPStore(
        LOCALHOST, port, world, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(
    port: int, world: int | None, timeout_s: float, host: str = LOCALHOST
) -> dist.TCPStore:
    """A connection to rank 0's store (a worker's, or a remote node's with `world` None); it
    keeps retrying to connect for `timeout_s`, so it may start before rank 0 listens."""
    return dist.TCPStore(
        host, port, world, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def init_group(
    store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float
) -> None:
    """Join the default process group; collectives fail after `timeout_s` without a peer."""
    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group already exists in this process: one "
            "tensor-parallel engine per process"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def leave_group(timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Destroy the default group (a later engine in this process may make its own); False if
    that did not end within `timeout_s`. The workers are gone by now, and destroying an NCCL
    communicator whose peers are gone can block forever (seen on a 2x H100 host after CUDA
    graphs had captured its collectives), so the destroy runs on a daemon thread that a stop
    does not wait for beyond the timeout."""
    if not dist.is_initialized():
        return True
    done = threading.Thread(target=dist.destroy_process_group, name="dlm-leave-group", daemon=True)
    done.start()
    done.join(timeout_s)
    return not done.is_alive()
