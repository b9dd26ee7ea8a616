"""An idle keep-alive connection outlives the client's own keep-alive: a client that reuses it
after a pause (httpx keeps idle connections 5 s, load balancers 60 s) is answered, not met by a
socket the server closed a moment before."""

from __future__ import annotations

import socket
import time

from apitest_server import MAIN_SERVER, get_server

SERVERS = {"main": MAIN_SERVER}


def _get(sock: socket.socket, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return head


def test_idle_connection_is_kept_past_the_clients_keep_alive():
    server = get_server("main")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        assert _get(sock, "/health").startswith(b"HTTP/1.1 200")
        time.sleep(7)  # longer than httpx's 5 s idle expiry (and the server's old 5 s timeout)
        assert _get(sock, "/health").startswith(b"HTTP/1.1 200")
