"""The OpenAI Files API over the job store: JSONL uploads for batches and the files batches produce."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.models import ApiKey, Batch, StoredFile
from api.settings import get_settings

BATCH_INPUT = "batch"
BATCH_OUTPUT = "batch_output"
Owned = TypeVar("Owned", StoredFile, Batch)


def jsonl_lines(content: bytes) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSONL file; ApiError names the first bad line."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"file: not UTF-8 text (byte {exc.start})", "file") from exc
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"file: line {number} is not valid JSON: {exc.msg}", "file") from exc
        if not isinstance(value, dict):
            raise ApiError(400, f"file: line {number} must be a JSON object, got {type(value).__name__}", "file")
        lines.append((number, value))
    return lines


def _check_batch_input(content: bytes) -> None:
    lines = jsonl_lines(content)
    limit = get_settings().max_batch_lines
    if not lines:
        raise ApiError(400, "file: a batch input file needs at least one request line", "file")
    if len(lines) > limit:
        raise ApiError(400, f"file: a batch input file may hold at most {limit} requests, got {len(lines)}", "file")


def create_file(session: Session, key: ApiKey, filename: str, purpose: str, content: bytes) -> StoredFile:
    """Store an uploaded file; batch inputs must be JSONL with one request object per line."""
    if purpose != BATCH_INPUT:
        raise ApiError(400, f"purpose must be '{BATCH_INPUT}', got '{purpose}'", "purpose")
    limit = get_settings().max_file_bytes
    if len(content) > limit:
        raise ApiError(413, f"file: {len(content)} bytes exceed the limit of {limit} bytes", "file")
    _check_batch_input(content)
    return store_file(session, key.id, filename, purpose, content)


def store_file(session: Session, owner_id: str, filename: str, purpose: str, content: bytes) -> StoredFile:
    """Add a file of the API key `owner_id` to the session (committed by the caller)."""
    stored = StoredFile(api_key_id=owner_id, filename=filename[:255], purpose=purpose, bytes=len(content),
                        content=content)
    session.add(stored)
    return stored


def get_owned(session: Session, key: ApiKey, model: type[Owned], object_id: str, what: str) -> Owned:
    """The caller's file or batch, or 404 (also for another key's, so ids reveal nothing)."""
    found = session.get(model, object_id)
    if found is None or found.api_key_id != key.id:
        raise ApiError(404, f"{what} {object_id} not found", f"{what}_id")
    return found


def get_file(session: Session, key: ApiKey, file_id: str) -> StoredFile:
    """The caller's file, or 404."""
    return get_owned(session, key, StoredFile, file_id, "file")


def list_files(session: Session, key: ApiKey, purpose: str | None) -> list[StoredFile]:
    """The caller's files, newest first."""
    query = select(StoredFile).where(StoredFile.api_key_id == key.id)
    if purpose is not None:
        query = query.where(StoredFile.purpose == purpose)
    return list(session.scalars(query.order_by(StoredFile.created_at.desc())))
