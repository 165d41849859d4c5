"""ASGI middleware refusing request bodies larger than the configured limit with 413."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.openai_responses import error_object

# Room for the multipart framing around an uploaded file.
UPLOAD_OVERHEAD_BYTES = 64 * 1024


class BodyTooLarge(Exception):
    """Raised inside receive() once a body passes the limit."""


class BodySizeLimit:
    """Answer 413 for bodies over max_bytes (or a path's own limit), by Content-Length up front or by counting."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope["path"], self.max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            await self._reject(send, max_bytes)
            return
        received = 0
        too_large = started = replaced = False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            received += len(message.get("body", b""))
            if received > max_bytes:
                too_large = True
                raise BodyTooLarge
            return message

        async def replacing_send(message: Message) -> None:
            # FastAPI turns an error raised while reading the body into its own 400, so a body cut off
            # here (a chunked one, without Content-Length) gets the 413 in place of what the app answers.
            nonlocal started, replaced
            if replaced:
                return
            if too_large and not started:
                replaced = True
                await self._reject(send, max_bytes)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, replacing_send)
        except BodyTooLarge:
            if not started and not replaced:
                await self._reject(send, max_bytes)

    async def _reject(self, send: Send, max_bytes: int) -> None:
        message = f"request body exceeds the limit of {max_bytes} bytes"
        # answered before any route: the job API's error fields and OpenAI's (type, param, code) in one object
        error = {**error_object(413, message, "body"), "field": "body", "status": 413}
        body = json.dumps({"error": error, "detail": message})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body.encode()})
