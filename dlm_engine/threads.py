"""Torch CPU threads for an engine that steps on its own thread (EngineLoop).

Once the process's *main* thread has run a parallel torch op with two threads (loading the
model, a warm-up), every other thread's parallel ops run markedly slower (a tiny-dlm step on
the engine thread, a single matmul alike; benchmarks/readme_chat.py, docs/benchmarks.md).
If the main thread stays single-threaded, a worker thread that sets its own
count runs at full speed. So the caller (the Triton model's `initialize`) keeps the main thread
at one thread before loading, and the engine thread takes the threads back when it starts.
"""

from __future__ import annotations

import torch

# A GPU engine's CPU ops are bookkeeping on small tensors: a few threads run them as fast as
# every core does, and one replica per GPU on a shared host, each with a thread per core, would
# oversubscribe the cores (OpenMP workers of two processes contending for each core).
GPU_ENGINE_THREADS = 4


def engine_threads(configured: int, default: int, device: torch.device) -> int:
    """The engine thread's torch thread count: `configured` when set (> 0), else `default`
    (the process's count) on the CPU and at most `GPU_ENGINE_THREADS` of it on a GPU."""
    if configured > 0:
        return configured
    return min(default, GPU_ENGINE_THREADS) if device.type == "cuda" else default


def hand_threads_to_engine_thread() -> int:
    """Make the calling (main) thread single-threaded for torch; return the thread count the
    engine thread should set (the process default, from OMP_NUM_THREADS or the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def use_threads(threads: int | None) -> None:
    """On the engine thread: run torch's CPU ops with `threads` threads (None: leave as is)."""
    if threads:
        torch.set_num_threads(threads)
