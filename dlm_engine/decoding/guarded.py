"""Worker threads with a large native stack, for llguidance's compiler.

llguidance compiles grammars recursively in native code: a deep enough grammar overflows the
calling thread's stack, a segfault that takes the whole model process down (Python's recursion
limit does not see native frames). Its work runs here instead, on threads whose stack
(`STACK_BYTES`) holds the deepest grammar that the shape limits (`constraint_limits.py`) and the
size cap let through, with a wide margin. The stack is virtual memory: only the pages touched
are ever resident.

Token masks of accepted grammars need no such stack (the shape limits keep grammars shallow):
they run in llguidance's own executor (`constraints.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# The deepest accepted grammars need about 30 MB (a 13,400-rule Lark chain in 200,000
# characters, were no rule limit set); 8 MB, a thread's usual stack, overflows at 3,500 rules.
STACK_BYTES = 256 << 20

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.get(name)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
            # the stack size applies to threads started while it is set: start them all now
            # (each first task waits for the others, so every task gets a thread of its own)
            started = threading.Barrier(workers)
            previous = threading.stack_size(STACK_BYTES)
            try:
                for f in [pool.submit(started.wait, 60) for _ in range(workers)]:
                    f.result()
            finally:
                threading.stack_size(previous)
            _pools[name] = pool
        return pool


def run(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a compile thread (large stack); its exception is raised here."""
    return _pool("dlm-grammar", 2).submit(fn, *args).result()
