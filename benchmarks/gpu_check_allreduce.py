"""The all-reduce a tensor-parallel layer ends with, timed each way PyTorch offers on this host:
NCCL (`dist.all_reduce`) and symmetric memory's one-shot and two-shot kernels
(`torch.ops.symm_mem`, peer-to-peer over NVLink; NVLink multicast stays off), each launched
eagerly and replayed from a CUDA graph, at the message sizes of a step (hidden 4,096 bf16 times
1 to 320 tokens, and larger).

    python benchmarks/gpu_check_allreduce.py [--world 2] [--out FILE]

Per size and way: microseconds an all-reduce (the mean over a run of back-to-back calls, the
copy into the symmetric buffer included) and whether every rank's sum is exact (the inputs are
small integers, so any order of addition gives the same bf16 sum). A layer of a batch-1 step
at two ranks all-reduces 4,096 x 1-32 values twice; that latency, not bandwidth, sets how much
tensor parallelism gains there.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096
TOKENS = (1, 4, 32, 64, 320, 2048)
CALLS = 50  # back-to-back all-reduces a timed run (and a captured graph)


def _ways(group_name: str, buf: torch.Tensor):
    import torch.distributed._symmetric_memory as symm_mem  # noqa: F401 (registers the ops)

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def one_shot(x: torch.Tensor) -> torch.Tensor:
        staged = buf[: x.numel()].view_as(x)
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group_name, x)

    def two_shot(x: torch.Tensor) -> torch.Tensor:
        staged = buf[: x.numel()].view_as(x)
        staged.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", group_name)
        return x.copy_(staged)

    return {"nccl": nccl, "symm_one_shot": one_shot, "symm_two_shot": two_shot}


def _time_eager(fn, x: torch.Tensor) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / CALLS


def _time_graph(fn, x: torch.Tensor) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / CALLS


def _exact(fn, rank: int, world: int, numel: int) -> bool:
    x = torch.full((numel,), float(rank + 1), device="cuda", dtype=torch.bfloat16)
    out = fn(x)
    torch.cuda.synchronize()
    return bool((out == world * (world + 1) / 2).all())


def _worker(rank: int, world: int, port: int, out: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    most = HIDDEN * max(TOKENS)
    buf = symm_mem.empty(most, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buf, group_name)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "world": world, "hidden": HIDDEN, "calls_per_run": CALLS, "sizes": []}  # fmt: skip
    for tokens in TOKENS:
        numel = HIDDEN * tokens
        row: dict = {"tokens": tokens, "kib": numel * 2 / 1024}
        for name, fn in _ways(group_name, buf).items():
            x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
            entry: dict = {}
            for mode, timer in (("eager_us", _time_eager), ("graph_us", _time_graph)):
                try:
                    entry[mode] = round(timer(fn, x), 2)
                except Exception as exc:  # a way this host or build lacks: recorded
                    entry[mode] = f"{type(exc).__name__}: {exc}"[:200]
                    torch.cuda.synchronize()
            try:
                entry["exact"] = _exact(fn, rank, world, numel)
            except Exception as exc:
                entry["exact"] = f"{type(exc).__name__}: {exc}"[:200]
            row[name] = entry
        report["sizes"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.barrier()
    if rank == 0:
        text = json.dumps(report, indent=2)
        if out:
            Path(out).write_text(text + "\n")
        print(text, flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--out")
    args = ap.parse_args()
    # NVLink multicast stays off (NVLS can take a shared host's GPUs out of service)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    mp.spawn(_worker, args=(args.world, args.port, args.out), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
