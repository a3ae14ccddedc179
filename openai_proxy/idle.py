"""An inactivity timeout for upstream streams: a silent Triton never hangs a client.

The whole-request timeout (``request_timeout_s``) is long, because diffusion requests may wait
in the model's queue; a stream that sends nothing at all for ``stream_idle_timeout_s`` (a
stopped or wedged model) is ended with a 504 / SSE error event instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


async def idle_timeout(
    source: AsyncIterable[T], timeout_s: float, on_timeout: Callable[[], BaseException]
) -> AsyncIterator[T]:
    """Yield from `source`; raise `on_timeout()` when no item arrives for `timeout_s`."""
    it = source.__aiter__()
    while True:
        try:
            item = await asyncio.wait_for(it.__anext__(), timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise on_timeout() from None
        yield item
