"""Large requests are parsed and tokenized off the thread that serves the others.

Triton calls ``execute()`` on the stub's one request thread: a megabyte prompt parsed and
tokenized there (seconds) delays every request behind it. Requests whose inputs exceed
``INLINE_BYTES`` go to a worker thread instead; small ones are still accepted inline, so they
never queue behind a large one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

INLINE_BYTES = 64 * 1024


def input_bytes(inputs: dict[str, np.ndarray]) -> int:
    """Payload bytes of a request's input tensors (BYTES elements by their length)."""
    total = 0
    for array in inputs.values():
        if array.dtype == np.object_:
            total += sum(len(x) for x in array.reshape(-1) if isinstance(x, bytes | str))
        else:
            total += array.nbytes
    return total


class Intake:
    """Routes each request's acceptance inline or to the large-request worker."""

    def __init__(self, workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dlm-intake")
        self.offloaded = 0  # large requests handed to the worker (for tests and logs)

    def accept(self, inputs: dict[str, np.ndarray], accept: Callable[[], None]) -> None:
        """Run `accept` (which must end its request whatever happens) inline or on the
        worker, by the size of `inputs`."""
        if input_bytes(inputs) <= INLINE_BYTES:
            accept()
            return
        self.offloaded += 1
        self._pool.submit(accept)

    def shutdown(self) -> None:
        """Finish what was handed over (each ends its request), then stop."""
        self._pool.shutdown(wait=True)
