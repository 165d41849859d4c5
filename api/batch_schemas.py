"""Schemas of the OpenAI Files and Batch APIs: the batch request body and the file and batch objects."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.schemas import Deleted, StorableStr
from core.models import Batch, StoredFile


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


class BatchCreate(BaseModel):
    """Body of POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: StorableStr = Field(min_length=1, max_length=64)
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: dict[StorableStr, StorableStr] | None = Field(None, max_length=16)


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"

    @classmethod
    def of(cls, stored: StoredFile) -> FileObject:
        """The file object of a stored file."""
        return cls(id=stored.id, bytes=stored.bytes, created_at=_unix(stored.created_at) or 0,
                   filename=stored.filename, purpose=stored.purpose)


class FileDeleted(Deleted):
    """OpenAI's answer to DELETE /v1/files/{id}."""

    object: Literal["file"] = "file"


class BatchObject(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: dict[str, int]
    metadata: dict[str, Any] | None

    @classmethod
    def of(cls, batch: Batch, request_counts: dict[str, int]) -> BatchObject:
        """The batch object of a stored batch and its current request counts."""
        errors = {"object": "list", "data": batch.errors} if batch.errors else None
        return cls(
            id=batch.id, endpoint=batch.endpoint, errors=errors, input_file_id=batch.input_file_id,
            completion_window=batch.completion_window, status=batch.status.value,
            output_file_id=batch.output_file_id, error_file_id=batch.error_file_id,
            created_at=_unix(batch.created_at) or 0, in_progress_at=_unix(batch.in_progress_at),
            expires_at=_unix(batch.expires_at), finalizing_at=_unix(batch.finalizing_at),
            completed_at=_unix(batch.completed_at), failed_at=_unix(batch.failed_at),
            expired_at=_unix(batch.expired_at),
            cancelling_at=_unix(batch.cancelling_at), cancelled_at=_unix(batch.cancelled_at),
            request_counts=request_counts, metadata=batch.metadata_,
        )


class BatchList(BaseModel):
    """A page of batches, newest first."""

    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileList(BaseModel):
    """A page of the caller's files."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool

