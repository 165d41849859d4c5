"""The OpenAI Batch API over the job store: lines fan out into jobs; output files are made once all are final."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from api.batch_input import build_line, format_errors
from api.batch_output import output_files
from api.errors import ApiError
from api.lifecycle import job_created, transition
from api.models import ApiKey, Batch, BatchRequest, BatchStatus, Job, JobStatus, new_id, utcnow
from api.openai_files import BATCH_INPUT, BATCH_OUTPUT, get_file, get_owned, store_file
from api.ratelimit import check_inflight

MAX_REPORTED_ERRORS = 100


def create_batch(
    session: Session, key: ApiKey, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None
) -> Batch:
    """Validate the input file and queue one job per line; a malformed file makes a failed batch naming its lines."""
    stored = get_file(session, key, input_file_id)
    if stored.purpose != BATCH_INPUT:
        raise ApiError(400, f"input_file_id: file {input_file_id} has purpose '{stored.purpose}', not 'batch'",
                       "input_file_id")
    batch = Batch(id=new_id("batch"), api_key_id=key.id, endpoint=endpoint, completion_window=window,
                  input_file_id=input_file_id, metadata_=metadata, status=BatchStatus.in_progress)
    lines, errors = format_errors(stored.content, endpoint)
    if errors:
        batch.status, batch.failed_at, batch.errors = BatchStatus.failed, utcnow(), errors[:MAX_REPORTED_ERRORS]
        session.add(batch)
        session.commit()
        return batch
    batch.in_progress_at = utcnow()
    built = [build_line(key, number, line, endpoint, batch.id) for number, line in lines]
    new_jobs = [line.job for line in built if line.job is not None]
    check_inflight(session, key, len(new_jobs))  # a batch's jobs count toward the key's cap like /v1/jobs
    for job in new_jobs:
        job.id = new_id("job")
    session.add(batch)
    session.add_all(new_jobs)
    session.flush()  # batch and jobs exist before the rows that point at them
    session.add_all(BatchRequest(batch_id=batch.id, line_number=line.line_number, custom_id=line.custom_id,
                                 job_id=line.job.id if line.job else None, error=line.error) for line in built)
    session.commit()
    for job in new_jobs:
        job_created(job)
    return settle(session, batch)


def request_counts(session: Session, batch: Batch) -> dict[str, int]:
    """OpenAI's request counts: total lines, completed (succeeded jobs), failed (failed, cancelled or refused)."""
    by_status = dict(session.execute(
        select(Job.status, func.count()).join(BatchRequest, BatchRequest.job_id == Job.id)
        .where(BatchRequest.batch_id == batch.id).group_by(Job.status)
    ).all())
    refused = session.scalar(
        select(func.count()).select_from(BatchRequest)
        .where(BatchRequest.batch_id == batch.id, BatchRequest.job_id.is_(None))
    ) or 0
    failed = refused + by_status.get(JobStatus.failed, 0) + by_status.get(JobStatus.cancelled, 0)
    total = refused + sum(by_status.values())
    return {"total": total, "completed": by_status.get(JobStatus.succeeded, 0), "failed": failed}


def settle(session: Session, batch: Batch) -> Batch:
    """Finish a batch whose jobs are all final: write its output and error files, then complete (or cancel) it."""
    if batch.status not in (BatchStatus.in_progress, BatchStatus.cancelling):
        return batch
    counts = request_counts(session, batch)
    if counts["completed"] + counts["failed"] < counts["total"]:
        return batch
    output, errors = output_files(session, batch)
    owner = batch.api_key_id
    output_file = store_file(session, owner, f"{batch.id}_output.jsonl", BATCH_OUTPUT, output) if output else None
    error_file = store_file(session, owner, f"{batch.id}_errors.jsonl", BATCH_OUTPUT, errors) if errors else None
    session.flush()
    now = utcnow()
    done: dict[str, Any] = (
        {"status": BatchStatus.completed, "completed_at": now} if batch.status is BatchStatus.in_progress
        else {"status": BatchStatus.cancelled, "cancelled_at": now}
    )
    stmt = update(Batch).where(Batch.id == batch.id, Batch.status == batch.status).values(
        output_file_id=output_file.id if output_file else None, error_file_id=error_file.id if error_file else None,
        **done,
    )
    if session.execute(stmt).rowcount != 1:  # another request settled it first
        session.rollback()
    else:
        session.commit()
    session.refresh(batch)
    return batch


def get_batch(session: Session, key: ApiKey, batch_id: str) -> Batch:
    """The caller's batch, settled if its jobs are done; 404 for another key's batch."""
    return settle(session, get_owned(session, key, Batch, batch_id, "batch"))


def cancel_batch(session: Session, key: ApiKey, batch_id: str) -> Batch:
    """Stop a batch: its queued jobs are cancelled, running ones finish, then it becomes cancelled."""
    batch = get_batch(session, key, batch_id)
    if batch.status is BatchStatus.cancelling:
        return batch
    stmt = update(Batch).where(Batch.id == batch.id, Batch.status == BatchStatus.in_progress).values(
        status=BatchStatus.cancelling, cancelling_at=utcnow())
    if session.execute(stmt).rowcount != 1:
        session.rollback()
        session.refresh(batch)
        raise ApiError(409, f"batch {batch_id} is already {batch.status.value} and cannot be cancelled", "batch_id")
    session.commit()
    queued = session.scalars(
        select(Job.id).join(BatchRequest, BatchRequest.job_id == Job.id)
        .where(BatchRequest.batch_id == batch.id, Job.status == JobStatus.queued)
    ).all()
    for job_id in queued:
        transition(session, job_id, JobStatus.cancelled, {JobStatus.queued})
    session.refresh(batch)
    return settle(session, batch)


def list_batches(session: Session, key: ApiKey, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    """A page of the caller's batches, newest first, after the batch id `after`; and whether more follow."""
    query = select(Batch).where(Batch.api_key_id == key.id)
    if after:
        anchor = get_batch(session, key, after)
        query = query.where(or_(Batch.created_at < anchor.created_at,
                                and_(Batch.created_at == anchor.created_at, Batch.id < anchor.id)))
    page = list(session.scalars(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)))
    return [settle(session, batch) for batch in page[:limit]], len(page) > limit
