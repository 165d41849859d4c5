"""The OpenAI Files and Batch APIs: upload a JSONL batch, run it as jobs, fetch its output and error files."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Query, Response, UploadFile

from api import batches, openai_files
from api.auth import CurrentKey, DbSession
from api.batch_schemas import BatchCreate, BatchList, BatchObject, FileDeleted, FileList, FileObject
from api.openai_errors import OpenAIRoute
from core.models import Batch

router = APIRouter(prefix="/v1", tags=["openai-batch"], route_class=OpenAIRoute)


@router.post("/files", response_model=FileObject)
def upload_file(
    key: CurrentKey, session: DbSession, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
) -> FileObject:
    """Upload a JSONL batch input file (purpose `batch`); every line is checked to be a JSON object as it is read."""
    stored = openai_files.create_file(session, key, file.filename or "upload.jsonl", purpose, file.file)
    session.commit()
    return FileObject.of(stored)


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, key: CurrentKey, session: DbSession) -> FileDeleted:
    """Delete one of the caller's files (batches that name it keep its id)."""
    openai_files.delete_file(session, key, file_id)
    return FileDeleted(id=file_id)


@router.get("/files", response_model=FileList)
def list_files(
    key: CurrentKey, session: DbSession, purpose: str | None = None, after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, order: Literal["asc", "desc"] = "desc",
) -> FileList:
    """The caller's files, newest first (`order=asc`: oldest first), a page of `limit` after the file `after`."""
    page, has_more = openai_files.list_files(session, key, purpose, after, limit, newest_first=order == "desc")
    data = [FileObject.of(f) for f in page]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=has_more)


@router.get("/files/{file_id}", response_model=FileObject)
def get_file(file_id: str, key: CurrentKey, session: DbSession) -> FileObject:
    """One of the caller's files."""
    return FileObject.of(openai_files.get_file(session, key, file_id))


@router.get("/files/{file_id}/content", response_class=Response)
def get_file_content(file_id: str, key: CurrentKey, session: DbSession) -> Response:
    """The bytes of one of the caller's files (batch outputs are JSONL)."""
    stored = openai_files.get_file(session, key, file_id)
    return Response(stored.content, media_type="application/jsonl")


def _batch_object(session: DbSession, batch: Batch) -> BatchObject:
    return BatchObject.of(batch, batches.request_counts(session, batch))


@router.post("/batches", response_model=BatchObject)
def create_batch(body: BatchCreate, key: CurrentKey, session: DbSession) -> BatchObject:
    """Start a batch: one job per input line, run with all other jobs."""
    batch = batches.create_batch(session, key, body.input_file_id, body.endpoint, body.completion_window,
                                 body.metadata)
    return _batch_object(session, batch)


@router.get("/batches", response_model=BatchList)
def list_batches(
    key: CurrentKey, session: DbSession, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
) -> BatchList:
    """The caller's batches, newest first."""
    page, has_more = batches.list_batches(session, key, after, limit)
    data = [_batch_object(session, batch) for batch in page]
    return BatchList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=has_more)


@router.get("/batches/{batch_id}", response_model=BatchObject)
def get_batch(batch_id: str, key: CurrentKey, session: DbSession) -> BatchObject:
    """One of the caller's batches with its request counts (its output files appear once all lines are done)."""
    return _batch_object(session, batches.get_batch(session, key, batch_id))


@router.post("/batches/{batch_id}/cancel", response_model=BatchObject)
def cancel_batch(batch_id: str, key: CurrentKey, session: DbSession) -> BatchObject:
    """Cancel a batch: lines not yet started never run; running ones finish."""
    return _batch_object(session, batches.cancel_batch(session, key, batch_id))
