"""Torch CPU threads for an engine that steps on its own thread (EngineLoop).

Measured on a 2-core AVX512 machine (benchmarks/readme_chat.py, docs/benchmarks.md): once the
process's *main* thread has run a parallel torch op with two threads (loading the model, a
warm-up), every other thread's parallel ops run about 1.5x slower (tiny-dlm step 13-16 ms on
the engine thread against 8 ms on the main thread; a 105x256 by 256x1024 matmul 265-305 us
against 195 us). If the main thread stays single-threaded, a worker thread that sets its own
count runs at full speed. So the caller (the Triton model's `initialize`) keeps the main thread
at one thread before loading, and the engine thread takes the threads back when it starts.
"""

from __future__ import annotations

import torch


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
