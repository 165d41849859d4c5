"""A local HTTP receiver for webhook tests: records every request and answers with scripted status codes."""

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
    """Serves on `host` (on `port`, or any free one when 0); answers `statuses` in order, then 200."""

    port: int = 0
    host: str = "127.0.0.1"
    statuses: list[int] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

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
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer((self.host, self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
