"""The OpenAI Batch API over the job store: lines fan out into jobs; a batch is refreshed whenever it is read.

How a running batch moves on (expiry, output files, the end of a cancel) is core/batch_progress.py, which the
workers drive too.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.batch_input import build_line, format_errors
from api.errors import ApiError
from api.openai_files import get_file, get_owned, owned_page
from api.ratelimit import check_inflight
from core.batch_progress import cancel_jobs, move_batch, refresh, unfinished_job_ids
from core.lifecycle import job_created
from core.models import ApiKey, Batch, BatchRequest, BatchStatus, Job, JobStatus, new_id, utcnow
from core.stored_files import BATCH_INPUT

MAX_REPORTED_ERRORS = 100
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}


def create_batch(
    session: Session, key: ApiKey, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None
) -> Batch:
    """Validate the input file and queue one job per line; a malformed file makes a failed batch naming its lines."""
    try:
        stored = get_file(session, key, input_file_id)
    except ApiError as exc:  # named as this request names the file
        raise ApiError(exc.status_code, f"input_file_id: {exc.message}", "input_file_id", exc.headers) from exc
    if stored.purpose != BATCH_INPUT:
        raise ApiError(400, f"input_file_id: file {input_file_id} has purpose '{stored.purpose}', not 'batch'",
                       "input_file_id")
    now = utcnow()
    # validation runs within this request, so the batch is returned past `validating`: in_progress or failed
    batch = Batch(id=new_id("batch"), api_key_id=key.id, endpoint=endpoint, completion_window=window,
                  input_file_id=input_file_id, metadata_=metadata, status=BatchStatus.validating,
                  created_at=now, expires_at=now + COMPLETION_WINDOWS[window])
    lines, errors = format_errors(stored.content, endpoint)
    if errors:
        batch.status, batch.failed_at, batch.errors = BatchStatus.failed, utcnow(), errors[:MAX_REPORTED_ERRORS]
        session.add(batch)
        session.commit()
        return batch
    batch.status, batch.in_progress_at = BatchStatus.in_progress, utcnow()
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
    return refresh(session, batch)


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


def get_batch(session: Session, key: ApiKey, batch_id: str) -> Batch:
    """The caller's batch, refreshed; 404 for another key's batch."""
    return refresh(session, get_owned(session, key, Batch, batch_id, "batch"))


def cancel_batch(session: Session, key: ApiKey, batch_id: str) -> Batch:
    """Stop a batch: its queued jobs are cancelled, running ones finish, then it becomes cancelled."""
    batch = get_batch(session, key, batch_id)
    if batch.status is BatchStatus.cancelling:
        return batch
    if batch.status is not BatchStatus.in_progress or not move_batch(
            session, batch, BatchStatus.cancelling, cancelling_at=utcnow()):
        raise ApiError(409, f"batch {batch_id} is already {batch.status.value} and cannot be cancelled", "batch_id")
    cancel_jobs(session, unfinished_job_ids(session, batch), {JobStatus.queued})
    return refresh(session, batch)


def list_batches(session: Session, key: ApiKey, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    """A page of the caller's batches, newest first, after the batch id `after`; and whether more follow."""
    page, has_more = owned_page(session, key, Batch, select(Batch).where(Batch.api_key_id == key.id), after, limit)
    return [refresh(session, batch) for batch in page], has_more
