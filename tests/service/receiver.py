"""A local HTTP receiver for webhook tests: records every request and answers with scripted status codes, or holds
every request until released (a receiver that does not answer)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    """One request the receiver got."""

    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class WebhookReceiver:
    """Serves on `host` (on `port`, or any free one when 0); answers `statuses` in order, then 200. While `held` is
    set, each request waits for `release()` before it is answered; `most_at_once` counts the requests it held at
    once."""

    port: int = 0
    host: str = "127.0.0.1"
    statuses: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    held: bool = False
    most_at_once: int = 0
    _released: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _at_once: int = 0

    @property
    def url(self) -> str:
        """The receiver's base URL."""
        assert self.server is not None
        return f"http://{self.host}:{self.server.server_address[1]}/hook"

    def start(self) -> WebhookReceiver:
        """Start serving in a daemon thread."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.received.append(Received(self.path, dict(self.headers.items()), body))
                if receiver.held:
                    receiver._hold()
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer((self.host, self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def _hold(self) -> None:
        with self._lock:
            self._at_once += 1
            self.most_at_once = max(self.most_at_once, self._at_once)
        self._released.wait()
        with self._lock:
            self._at_once -= 1

    def release(self) -> None:
        """Answer every held request, and the later ones at once."""
        self._released.set()

    def stop(self) -> None:
        """Stop serving."""
        self.release()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
