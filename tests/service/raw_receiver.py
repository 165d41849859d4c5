"""Webhook receivers that misbehave on purpose, on 127.0.0.1: endless bodies, drip-fed answers, answers held back."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ENDLESS_BODY_CAP_BYTES = 256 << 20  # an "endless" body stops here, so a broken client fails the test, not the host
DRIP_HEAD = b"HTTP/1.1 200 OK\r\nX-Drip: " + b"." * 300 + b"\r\nContent-Length: 0\r\n\r\n"


@dataclass
class RawReceiver:
    """Reads each HTTP request, then lets `respond` write raw bytes; records what happened."""

    respond: Callable[[RawReceiver, socket.socket], None]
    num_requests: int = 0
    sent_bytes: int = 0
    hung_up: bool = False  # whether the client closed the connection before the answer was complete
    request_arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    server: socketserver.ThreadingTCPServer | None = None
    done: list[threading.Thread] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The receiver's URL."""
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def start(self) -> RawReceiver:
        """Serve in a daemon thread."""
        receiver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                receiver.done.append(threading.current_thread())
                _read_request(self.request)
                receiver.num_requests += 1
                receiver.request_arrived.set()
                try:
                    receiver.respond(receiver, self.request)
                except OSError:  # the client hung up: what these receivers exist to provoke
                    receiver.hung_up = True

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and wait for the connections' handlers to finish."""
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
        for thread in self.done:
            thread.join()


def _read_request(sock: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)


def endless_body(receiver: RawReceiver, sock: socket.socket) -> None:
    """A 200 whose body never ends (until the cap)."""
    sock.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    chunk = b"x" * (64 << 10)
    while receiver.sent_bytes < ENDLESS_BODY_CAP_BYTES:
        sock.sendall(chunk)
        receiver.sent_bytes += len(chunk)


def drip(receiver: RawReceiver, sock: socket.socket) -> None:
    """A 200 sent one byte every 0.1 s: each read is quick, the whole answer takes 35 s."""
    for byte in DRIP_HEAD:
        sock.sendall(bytes([byte]))
        receiver.sent_bytes += 1
        time.sleep(0.1)


def held_until_released(receiver: RawReceiver, sock: socket.socket) -> None:
    """A 200 sent only once the test sets `release`."""
    receiver.release.wait()
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
