"""The proxy's connections have Nagle's algorithm off (openai_proxy.listen says why)."""

from __future__ import annotations

import socket

import uvicorn

from openai_proxy.listen import listening_socket


def _accepted_nodelay(sock: socket.socket) -> int:
    sock.listen()
    with socket.create_connection(sock.getsockname()[:2]) as client:
        accepted, _ = sock.accept()
        with accepted:
            client.sendall(b"x")
            return accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_uvicorn_alone_leaves_nagle_on_for_accepted_connections() -> None:
    """The reason for the module: if uvicorn ever sets it itself, this fails and it can go."""
    config = uvicorn.Config(lambda scope, receive, send: None, host="127.0.0.1", port=0)
    with config.bind_socket() as sock:
        assert _accepted_nodelay(sock) == 0


def test_accepted_connections_have_nodelay() -> None:
    config = uvicorn.Config(lambda scope, receive, send: None, host="127.0.0.1", port=0)
    with listening_socket(config) as sock:
        assert _accepted_nodelay(sock) == 1
