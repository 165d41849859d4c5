"""The OpenAI Files API over the job store: JSONL uploads for batches, the files batches produce, deletion, quotas."""

from __future__ import annotations

from typing import Any, BinaryIO, TypeVar

from sqlalchemy import Select, and_, func, or_, select, update
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.file_upload import parse_line, read_jsonl_upload
from core.models import ApiKey, Batch, StoredFile, utcnow
from core.settings import get_settings
from core.stored_files import BATCH_INPUT, store_file

Owned = TypeVar("Owned", StoredFile, Batch)


def jsonl_lines(content: bytes) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSONL file; ApiError names the first bad line."""
    lines = ((number, parse_line(number, raw)) for number, raw in enumerate(content.split(b"\n"), start=1))
    return [(number, value) for number, value in lines if value is not None]


def _check_quota(session: Session, key: ApiKey, new_bytes: int) -> None:
    settings = get_settings()
    num_files, num_bytes = session.execute(
        select(func.count(), func.coalesce(func.sum(StoredFile.bytes), 0))
        .where(StoredFile.api_key_id == key.id, StoredFile.deleted_at.is_(None))
    ).one()
    if num_files + 1 > settings.max_files_per_key:
        raise ApiError(400, f"file: this API key already has {num_files} files, the most allowed is "
                            f"{settings.max_files_per_key}; delete some (DELETE /v1/files/{{id}})", "file")
    if num_bytes + new_bytes > settings.max_file_storage_bytes_per_key:
        raise ApiError(400, f"file: this API key's files hold {num_bytes} bytes; {new_bytes} more would pass the "
                            f"quota of {settings.max_file_storage_bytes_per_key} bytes; delete some "
                            "(DELETE /v1/files/{id})", "file")


def create_file(session: Session, key: ApiKey, filename: str, purpose: str, upload: BinaryIO) -> StoredFile:
    """Store an uploaded file, read in chunks; batch inputs must be JSONL with one request object per line."""
    if purpose != BATCH_INPUT:
        raise ApiError(400, f"purpose must be '{BATCH_INPUT}', got '{purpose}'", "purpose")
    if "\x00" in filename:
        raise ApiError(400, "file: the filename must not contain the NUL character", "file")
    settings = get_settings()
    content = read_jsonl_upload(upload, settings.max_file_bytes, settings.max_batch_lines)
    _check_quota(session, key, len(content))
    return store_file(session, key.id, filename, purpose, content)


def get_owned(session: Session, key: ApiKey, model: type[Owned], object_id: str, what: str) -> Owned:
    """The caller's file or batch, or 404 (also for another key's, so ids reveal nothing)."""
    found = session.get(model, object_id) if "\x00" not in object_id else None  # PostgreSQL refuses NUL
    if found is None or found.api_key_id != key.id:
        raise ApiError(404, f"{what} {object_id} not found", f"{what}_id")
    return found


def owned_page(session: Session, key: ApiKey, model: type[Owned], query: Select[tuple[Owned]], after: str | None,
               limit: int, newest_first: bool = True) -> tuple[list[Owned], bool]:
    """A page of `query` (the caller's files or batches) in creation order, after the object `after` (a cursor:
    404 naming `after` when it is not the caller's); and whether more follow."""
    if after:
        anchor = session.get(model, after) if "\x00" not in after else None
        if anchor is None or anchor.api_key_id != key.id:
            raise ApiError(404, f"after: no object {after} to list after", "after")
        later, earlier = model.created_at > anchor.created_at, model.created_at < anchor.created_at
        same_time = model.created_at == anchor.created_at
        query = query.where(or_(earlier, and_(same_time, model.id < anchor.id)) if newest_first
                            else or_(later, and_(same_time, model.id > anchor.id)))
    order = (model.created_at.desc(), model.id.desc()) if newest_first else (model.created_at, model.id)
    page = list(session.scalars(query.order_by(*order).limit(limit + 1)))
    return page[:limit], len(page) > limit


def get_file(session: Session, key: ApiKey, file_id: str) -> StoredFile:
    """The caller's file, or 404 (also once deleted)."""
    stored = get_owned(session, key, StoredFile, file_id, "file")
    if stored.deleted_at is not None:
        raise ApiError(404, f"file {file_id} not found", "file_id")
    return stored


def list_files(session: Session, key: ApiKey, purpose: str | None, after: str | None, limit: int,
               newest_first: bool) -> tuple[list[StoredFile], bool]:
    """A page of the caller's files after the file `after`; and whether more follow."""
    query = select(StoredFile).where(StoredFile.api_key_id == key.id, StoredFile.deleted_at.is_(None))
    if purpose is not None:
        query = query.where(StoredFile.purpose == purpose)
    return owned_page(session, key, StoredFile, query, after, limit, newest_first)


def delete_file(session: Session, key: ApiKey, file_id: str) -> None:
    """Delete one of the caller's files: its content goes, its row stays marked deleted for the batches naming it."""
    get_file(session, key, file_id)
    session.execute(update(StoredFile).where(StoredFile.id == file_id, StoredFile.deleted_at.is_(None))
                    .values(deleted_at=utcnow(), content=b""))
    session.commit()
