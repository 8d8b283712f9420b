"""Listening sockets for the servers (bound before the model loads, so a taken port fails fast)."""
from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: any free one).

    Raises:
        OSError: the address is in use or cannot be bound (the message names it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
        addr = infos[0][4]
    except socket.gaierror as e:
        raise OSError(f"cannot resolve host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    return sock
