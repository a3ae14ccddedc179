"""Runs a call's jobs (n choices x prompts) concurrently and merges their events."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING

from .converters import TritonEvent, TritonJob

if TYPE_CHECKING:
    from .triton_backend import TritonBackend


class FanIn:
    """Runs a call's jobs (n choices x prompts) concurrently and merges their events.

    Tasks start at construction. `cancel()` is synchronous on purpose: it must work from
    `finally` blocks that run inside an already-cancelled scope (client disconnects).
    """

    def __init__(self, backend: TritonBackend, model: str, jobs: list[TritonJob]) -> None:
        self._items: deque[tuple[TritonJob, TritonEvent | None, BaseException | None]] = deque()
        self._wake = asyncio.Event()
        self._remaining = len(jobs)
        self._backend = backend
        self._model = model
        self._tasks = [asyncio.create_task(self._worker(j), name=j.request_id) for j in jobs]

    async def _worker(self, job: TritonJob) -> None:
        try:
            async for event in self._backend.generate(self._model, job):
                self._push((job, event, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._push((job, None, exc))
        finally:
            self._push((job, None, None))

    def _push(self, item: tuple[TritonJob, TritonEvent | None, BaseException | None]) -> None:
        self._items.append(item)
        self._wake.set()

    async def raise_early_error(self, timeout: float) -> None:
        """Wait up to `timeout` for the first event; raise now if it is an error.

        Lets a streaming call answer a real HTTP 400/503 for errors Triton reports at once,
        before the SSE headers are sent.
        """
        if not self._items and timeout > 0:
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
        for _, _, exc in self._items:
            if exc is not None:
                self.cancel()
                raise exc

    def __aiter__(self) -> FanIn:
        return self

    async def __anext__(self) -> tuple[TritonJob, TritonEvent]:
        while True:
            while not self._items:
                if self._remaining == 0:
                    raise StopAsyncIteration
                self._wake.clear()
                await self._wake.wait()
            job, event, exc = self._items.popleft()
            if exc is not None:
                self.cancel()
                raise exc
            if event is None:
                self._remaining -= 1
                continue
            return job, event

    def cancel(self) -> None:
        for t in self._tasks:
            if not t.done():
                t.cancel()
