"""The proxy's listening sockets, with Nagle's algorithm off for every connection.

asyncio turns Nagle off (TCP_NODELAY) only on sockets created with ``proto=IPPROTO_TCP``;
uvicorn's ``Config.bind_socket()`` creates them with ``proto=0``, so every accepted connection
kept Nagle on. uvicorn writes a response's headers and body in two sends: the body then waited
for the client's delayed ACK of the headers, 40 ms on Linux, whenever a client sent its next
request on the same connection right away (each back-to-back non-streamed call through the
proxy paid that delay over the same call through Triton). Linux copies TCP_NODELAY from a
listening socket to the connections it accepts, so it is set once here.
"""

from __future__ import annotations

import socket

import uvicorn


def listening_socket(config: uvicorn.Config) -> socket.socket:
    """``config``'s bound socket; a TCP one with TCP_NODELAY for the connections it accepts."""
    sock = config.bind_socket()
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
