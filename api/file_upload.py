"""Reading an uploaded JSONL batch file in chunks, checking each line as it arrives and stopping at the limits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, BinaryIO

from api.errors import ApiError

CHUNK_BYTES = 1 << 16


def parse_line(number: int, raw: bytes) -> dict[str, Any] | None:
    """The JSON object on one line (None when blank); ApiError naming the line when it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"file: line {number} is not UTF-8 text (byte {exc.start})", "file") from exc
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"file: line {number} is not valid JSON: {exc.msg}", "file") from exc
    if not isinstance(value, dict):
        raise ApiError(400, f"file: line {number} must be a JSON object, got {type(value).__name__}", "file")
    return value


def _lines(stream: BinaryIO, content: bytearray, max_bytes: int) -> Iterator[bytes]:
    """Each line of the stream as soon as it is complete, appending what is read to `content`."""
    pending = bytearray()
    while chunk := stream.read(CHUNK_BYTES):
        if len(content) + len(chunk) > max_bytes:
            raise ApiError(413, f"file: larger than the limit of {max_bytes} bytes", "file")
        content += chunk
        first, *rest = chunk.split(b"\n")
        pending += first
        if rest:
            yield bytes(pending)
            yield from rest[:-1]
            pending = bytearray(rest[-1])
    yield bytes(pending)


def read_jsonl_upload(stream: BinaryIO, max_bytes: int, max_lines: int) -> bytes:
    """The upload's bytes, each line checked as it is read: 413 past max_bytes or max_lines, 400 at a bad line."""
    content = bytearray()
    num_requests = 0
    for number, raw in enumerate(_lines(stream, content, max_bytes), start=1):
        num_requests += parse_line(number, raw) is not None
        if num_requests > max_lines:
            raise ApiError(413, f"file: a batch input file may hold at most {max_lines} requests", "file")
    if not num_requests:
        raise ApiError(400, "file: a batch input file needs at least one request line", "file")
    return bytes(content)
