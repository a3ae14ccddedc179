"""`python -m openai_proxy --port 9000 --triton-url localhost:8001`: serve with uvicorn.

On SIGTERM/SIGINT new calls get 503 `draining` while running responses (streams included)
finish for up to --drain-timeout seconds (openai_proxy/drain.py); then uvicorn closes the
listener and the lifespan closes the Triton clients.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from collections.abc import Sequence

import uvicorn

from .app import create_app
from .config import config_from_args
from .drain import DrainingServer
from .listen import listening_socket
from .security import check_exposure


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv)
        check_exposure(cfg)
    except ValueError as exc:
        print(f"openai_proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(cfg)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=max(1, round(cfg.drain_timeout_s)),
        lifespan="on",
        proxy_headers=False,
    )
    server = DrainingServer(
        config,
        begin_drain=app.state.begin_drain,
        in_flight=app.state.in_flight,
        drain_timeout_s=cfg.drain_timeout_s,
    )
    # One server on both sockets (API, and /metrics when it has its own port): one lifespan,
    # one drain; security.MetricsGate routes by the connection's local port.
    sockets = [listening_socket(config)]
    if cfg.metrics_port:
        metrics = uvicorn.Config(
            config.app, host=cfg.metrics_host or cfg.host, port=cfg.metrics_port
        )
        sockets.append(listening_socket(metrics))
    # uvicorn re-raises the caught signal after its graceful shutdown, so the process would die
    # "by SIGTERM" (status -15) even after a clean drain. No-op handlers make it exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # The app and its imports live as long as the process: frozen, they are out of the cyclic
    # collector's sight. Unfrozen, a full collection walks them with the event loop stopped
    # for tens of ms, so a burst of streams can reach Triton in two parts, splitting a cached
    # batch (figures in docs/benchmarks.md).
    gc.freeze()
    server.run(sockets=sockets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
