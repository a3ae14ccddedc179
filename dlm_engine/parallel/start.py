"""Starting a tensor-parallel engine: rank 0 resolves the checkpoint, starts the workers,
joins the process group with them and loads its own shard while they load theirs. Over
several hosts (`tensor_parallel_nodes`) it starts those of its own host, publishes the spec on
its store and waits for every other host's node process (`node.py`) to start the rest."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import EngineConfig
from ..fp8_checkpoint import fp8_format
from ..gptq_checkpoint import int4_format
from ..hub import resolve_checkpoint
from ..loader import LoadedModel, load_checkpoint
from ..models import Family, build_model, detect_family
from ..threads import engine_threads
from .channel import Channel
from .group import LOCALHOST, host_store, init_group, rank_device
from .model import ParallelLM
from .sharding import check_fp8_split, read_shard, rules_for, shard_model
from .workers import SPEC_KEY, WorkerSet

# a collective (or the first load) waits this long for a silent peer before failing; a
# worker that exits is reported at once (WorkerSet.check), this is the backstop
TIMEOUT_S = 300.0
# the other hosts' ranks may first download the checkpoint: rank 0 waits this long for them
# to join the group once their node process has come (TIMEOUT_S) and found no error
NODE_FETCH_TIMEOUT_S = 3600.0


# quantization that runs on every rank's shard after its load (per-channel scales of a
# row-parallel shard are then computed over the shard's columns: see `RowParallelFp8Linear`)
PARALLEL_QUANTIZATION = ("fp8",)


def check_supported(
    config: EngineConfig, raw: dict[str, Any], family: Family, path: Path | None = None
) -> None:
    """Refuse, naming the setting, what tensor parallelism does not run yet. FP8 runs: a
    published FP8 checkpoint (each rank reads its slices of the weights and of their scales;
    `path` lets a split that would cut a scale block be refused here, before any rank starts)
    and `quantization=fp8` (each rank quantizes its own shard)."""
    world = config.tensor_parallel_size
    if config.quantization and config.quantization not in PARALLEL_QUANTIZATION:
        raise ValueError(
            f"quantization={config.quantization} is not supported with "
            f"tensor_parallel_size {world} yet (supported: {', '.join(PARALLEL_QUANTIZATION)})"
        )
    if int4_format(raw) is not None:
        raise ValueError(
            f"GPTQ/AWQ checkpoints are not supported with tensor_parallel_size {world} yet"
        )
    fp8 = fp8_format(raw)  # an unknown quant_method: a clear error here
    # stacked experts (DiffusionGemma) have no split of a published FP8 checkpoint's scales
    if fp8 is not None and family.shard_rules is not None and family.shard_rules.expert_stack:
        raise ValueError(
            f"FP8 checkpoints are not supported for the {family.name} family with "
            f"tensor_parallel_size {world} yet"
        )
    rules_for(family.name, config.expert_parallel)  # no sharding table: a clear error
    if fp8 is not None and path is not None:
        check_fp8_split(path, family.name, raw, world, bool(config.expert_parallel))
    with torch.device("meta"):  # heads and widths that do not divide: refused before any start
        shard_model(
            build_model(family, raw), family.name, world, expert_parallel=config.expert_parallel
        )


def shard_reader(world: int, rank: int, expert_parallel: bool = False):
    """The loader's `weights` hook for `rank`: shard the meta model, read its slices (and
    with `expert_parallel` only its own routed experts)."""

    def read(
        model: nn.Module,
        path: Path,
        config: dict[str, Any],
        family: Family,
        device: torch.device,
        dtype: torch.dtype,
    ) -> dict[str, torch.Tensor]:
        shard_model(model, family.name, world, rank=rank, expert_parallel=expert_parallel)
        return read_shard(path, family.name, config, rank, world, device, dtype, expert_parallel)

    return read


def load_rank(spec: dict[str, Any], rank: int, world: int) -> LoadedModel:
    """Rank `rank`'s shard of the checkpoint at `spec["path"]` (a folder on this host), on
    its host's `local_rank`-th device."""
    device = rank_device(spec["device"], int(spec.get("local_rank", rank)))
    reader = shard_reader(world, rank, bool(spec.get("expert_parallel")))
    quantization = spec.get("quantization")  # each rank quantizes its own shard
    return load_checkpoint(spec["path"], spec["dtype"], str(device), quantization, weights=reader)


def worker_threads(config: Any) -> int:
    """Torch CPU threads of each worker rank: the caller's count on the CPU, on a GPU the
    engine thread's (`engine_threads`: at most a few unless configured)."""
    device = torch.device(config.device)
    if device.type == "cpu":
        return torch.get_num_threads()
    return engine_threads(int(config.engine_threads), os.cpu_count() or 1, device)


def start_tensor_parallel(config: EngineConfig) -> LoadedModel:
    """Rank 0's loaded model (a `ParallelLM` over its shard) with workers 1..N-1 running
    (those of other hosts under their node processes)."""
    world, nodes = int(config.tensor_parallel_size), int(config.tensor_parallel_nodes)
    if str(config.model).startswith("random:"):
        raise ValueError("random checkpoints are not supported with tensor_parallel_size > 1")
    path = resolve_checkpoint(config.model, config.revision)  # once, before any worker reads
    raw = json.loads((path / "config.json").read_text())
    family = detect_family(raw)
    check_supported(config, raw, family, path)
    store = host_store(world, TIMEOUT_S, int(config.tensor_parallel_port) if nodes > 1 else 0)
    spec = {
        "path": str(path),
        # what a node resolves on its own host (rank 0's folder may not exist there)
        "model": str(config.model),
        "revision": config.revision,
        "nodes": nodes,
        "host": LOCALHOST,  # a node process gives its workers rank 0's address instead
        "dtype": config.dtype,
        "device": config.device,
        "world": world,
        "port": store.port,
        "timeout_s": TIMEOUT_S,
        # a GPU rank's CPU work is bookkeeping: a few threads, so the ranks of a host (and
        # other replicas beside them) do not each take every core (dlm_engine/threads.py)
        "threads": worker_threads(config),
        # the model runner compiles the elementwise pieces on CUDA: every rank alike, so the
        # replicated hidden states (and LLaDA2's routing of them) agree bit for bit
        "fused_kernels": bool(config.fused_kernels),
        "expert_gemm": config.expert_gemm,  # every rank alike
        "expert_parallel": bool(config.expert_parallel),
        "quantization": config.quantization,
    }
    if nodes > 1:
        store.set(SPEC_KEY, json.dumps(spec))
    workers = WorkerSet(spec, world, store)
    try:
        workers.wait_nodes(TIMEOUT_S)
        workers.wait_joining(TIMEOUT_S if nodes == 1 else max(TIMEOUT_S, NODE_FETCH_TIMEOUT_S))
        init_group(store, 0, world, rank_device(config.device, 0), TIMEOUT_S)
        loaded = load_rank(spec, 0, world)
        workers.wait_ready(TIMEOUT_S)
    except BaseException:
        workers.stop()
        raise
    if family.uniform_diffusion:  # DiffusionGemma: its own calls (encode, decode_hidden)
        from .gemma import ParallelGemma

        model: nn.Module = ParallelGemma(loaded.model, Channel(store), workers)
    else:
        model = ParallelLM(loaded.model, Channel(store), workers)
    return dataclasses.replace(loaded, model=model)
