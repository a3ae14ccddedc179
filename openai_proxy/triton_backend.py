"""Triton behind the proxy: the server pool (`triton_pool`) plus one stream per job
(`triton_stream`), with one retry on another server for a job that received nothing yet.

`FanIn` (`fan_in`) and `decode_result` are re-exported here for callers of the old module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from .config import ProxyConfig
from .converters import TritonEvent, TritonJob
from .errors import ServiceUnavailable
from .fan_in import FanIn
from .triton_pool import BackendState, TritonPool
from .triton_stream import TritonStreams, decode_result, request_inputs

__all__ = [
    "BackendState",
    "FanIn",
    "TritonBackend",
    "TritonPool",
    "decode_result",
    "request_inputs",
]


class TritonBackend(TritonPool):
    """The pool, able to run a job: requests go to the least loaded ready server."""

    def __init__(self, config: ProxyConfig) -> None:
        super().__init__(config)
        self.streams = TritonStreams(config, self)

    @property
    def streams_opened(self) -> int:
        return self.streams.opened

    @property
    def streams_cancelled(self) -> int:
        return self.streams.cancelled

    async def generate(self, model: str, job: TritonJob) -> AsyncIterator[TritonEvent]:
        """One Triton stream for one job. Closing the generator cancels the stream at once."""
        tried: set[str] = set()
        while True:
            st = self.pick(model, tried)
            if st is None:
                if not tried:
                    await self.check_model(model)  # raises 404 / 503 with the right message
                    st = self.pick(model, tried)
                if st is None:
                    raise self.unavailable()
            tried.add(st.url)
            got_any = False
            try:
                async for event in self.streams.open(st, model, job):
                    got_any = True
                    yield event
                return
            except ServiceUnavailable as err:
                # Nothing received yet and this server is gone or full: another URL may serve it.
                if err.code == "triton_unavailable":
                    st.ready = False
                if got_any or len(tried) >= len(self._states):
                    raise
