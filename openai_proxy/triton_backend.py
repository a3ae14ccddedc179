"""Triton behind the proxy: the server pool (`triton_pool`) plus one stream per job
(`triton_stream`), with one retry on another server for a job that received nothing yet.

`FanIn` (`fan_in`) and `decode_result` are re-exported here for callers of the old module.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from .config import ProxyConfig
from .converters import TritonEvent, TritonJob
from .errors import ProxyError, ServiceUnavailable
from .fan_in import FanIn
from .replicas import Outcome, RetryBudget, classify
from .triton_pool import BackendState, TritonPool
from .triton_stream import TritonStreams, decode_result, request_inputs

log = logging.getLogger("openai_proxy.triton")

__all__ = [
    "BackendState",
    "FanIn",
    "TritonBackend",
    "TritonPool",
    "decode_result",
    "request_inputs",
]


class TritonBackend(TritonPool):
    """The pool, able to run a job: requests go to the least loaded usable replica."""

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
        """One Triton stream for one job. Closing the generator cancels the stream at once.

        Until an event with text reaches the caller, a replica's failure moves the job to
        another replica (`RetryBudget`: refusals are free, a failure uses a retry); after that
        the error goes to the caller, which ends the client's stream with an error event.
        """
        budget = RetryBudget(self.config.retries)
        last_error: ProxyError | None = None
        while True:
            st = self.pick(model, budget.tried)
            if st is None:
                if last_error is not None:
                    raise last_error
                await self.check_model(model)  # raises 404 / 503 with the right message
                st = self.pick(model, budget.tried)
                if st is None:
                    raise self.unavailable()
            budget.tried.add(st.url)
            started = False
            try:
                async for event in self.streams.open(st, model, job):
                    if not started and event.final and event.finish_reason == "abort":
                        # Aborted by the server (drain timeout, shutdown) before any text.
                        raise ServiceUnavailable(
                            f"generation aborted by Triton {st.url}", self.config.retry_after_s
                        )
                    started = started or bool(event.text) or event.canvas is not None
                    yield event
                self.pool.report(st, Outcome.OK)
                return
            except ProxyError as err:
                outcome = classify(err)
                self.pool.report(st, outcome, err.message)
                if started or not budget.allows_another(outcome):
                    raise
                last_error = err
                st.retried_away += 1
                log.warning("retrying %s elsewhere after %s: %s", job.request_id, st.url, err)
