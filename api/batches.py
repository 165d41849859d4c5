"""The OpenAI Batch API over the job store: lines fan out into jobs; output files are made once all are final.

A batch moves on through `refresh`: when one of its jobs ends (the worker), on every reaper pass, and
when it is read. Each move is a compare-and-set on its status, so racing callers move it once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from api.batch_input import build_line, format_errors
from api.batch_output import output_files
from api.errors import ApiError
from api.openai_files import BATCH_INPUT, BATCH_OUTPUT, get_file, get_owned, store_file
from api.ratelimit import check_inflight
from core import streams
from core.lifecycle import job_created, transition
from core.models import ApiKey, Batch, BatchRequest, BatchStatus, Job, JobStatus, new_id, utcnow
from core.settings import get_settings

MAX_REPORTED_ERRORS = 100
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
OPEN_STATUSES = (BatchStatus.in_progress, BatchStatus.finalizing, BatchStatus.cancelling)
UNFINISHED_JOBS = (JobStatus.queued, JobStatus.running)
CANCELLED_LINE = {"code": "batch_cancelled", "message": "The batch was cancelled before this request finished."}
EXPIRED_LINE = {"code": "batch_expired",
                "message": "This request could not be executed before the completion window expired."}


def create_batch(
    session: Session, key: ApiKey, input_file_id: str, endpoint: str, window: str, metadata: dict[str, str] | None
) -> Batch:
    """Validate the input file and queue one job per line; a malformed file makes a failed batch naming its lines."""
    stored = get_file(session, key, input_file_id)
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


def _unfinished_job_ids(session: Session, batch: Batch, limit: int | None = None) -> list[str]:
    # newest lines first: they run last, so while a batch runs the first row read is already unfinished
    query = (select(Job.id).join(BatchRequest, BatchRequest.job_id == Job.id)
             .where(BatchRequest.batch_id == batch.id, Job.status.in_(UNFINISHED_JOBS))
             .order_by(BatchRequest.line_number.desc()).limit(limit))
    return list(session.scalars(query))


def _move(session: Session, batch: Batch, to: BatchStatus, **values: Any) -> bool:
    """Compare-and-set the batch from its current status to `to`; commits and says whether this caller won."""
    stmt = update(Batch).where(Batch.id == batch.id, Batch.status == batch.status).values(status=to, **values)
    won = session.execute(stmt).rowcount == 1
    if won:
        session.commit()
    else:  # another caller moved it first; roll back whatever this one wrote with it (its output files)
        session.rollback()
    session.refresh(batch)
    return won


def _close(session: Session, batch: Batch, to: BatchStatus, cancelled_line: dict[str, str]) -> None:
    """Write the output and error files of a batch whose jobs are all final and move it to its final state."""
    output, errors = output_files(session, batch, cancelled_line)
    owner = batch.api_key_id
    output_file = store_file(session, owner, f"{batch.id}_output.jsonl", BATCH_OUTPUT, output) if output else None
    error_file = store_file(session, owner, f"{batch.id}_errors.jsonl", BATCH_OUTPUT, errors) if errors else None
    session.flush()
    _move(session, batch, to, **{f"{to.value}_at": utcnow()},
          output_file_id=output_file.id if output_file else None, error_file_id=error_file.id if error_file else None)


def _cancel_jobs(session: Session, job_ids: list[str], allowed_from: set[JobStatus]) -> None:
    """Cancel these jobs if still in `allowed_from`; a running one is aborted by its worker."""
    for job_id in job_ids:
        if transition(session, job_id, JobStatus.cancelled, allowed_from) is not None:
            streams.request_cancel(streams.redis_client(), job_id)


def _expire(session: Session, batch: Batch) -> None:
    """Past its window: cancel what has not finished, then close the batch as expired with what did (partial files)."""
    _cancel_jobs(session, _unfinished_job_ids(session, batch), set(UNFINISHED_JOBS))
    _close(session, batch, BatchStatus.expired, EXPIRED_LINE)


def _finalizing_is_stale(batch: Batch) -> bool:
    # finalizing outlives the one call that writes the files only when that caller died: take over after a grace
    grace = timedelta(seconds=get_settings().reconcile_grace_s)
    return batch.finalizing_at is not None and utcnow() - batch.finalizing_at > grace


def refresh(session: Session, batch: Batch) -> Batch:
    """Move an open batch on: expire it past its window, finalize it once its jobs are all final."""
    if batch.status is BatchStatus.in_progress and batch.expires_at is not None and utcnow() >= batch.expires_at:
        _expire(session, batch)
    elif batch.status is BatchStatus.in_progress and not _unfinished_job_ids(session, batch, limit=1):
        if _move(session, batch, BatchStatus.finalizing, finalizing_at=utcnow()):
            _close(session, batch, BatchStatus.completed, CANCELLED_LINE)
    elif batch.status is BatchStatus.cancelling and not _unfinished_job_ids(session, batch, limit=1):
        _close(session, batch, BatchStatus.cancelled, CANCELLED_LINE)
    elif batch.status is BatchStatus.finalizing and _finalizing_is_stale(batch):
        _close(session, batch, BatchStatus.completed, CANCELLED_LINE)
    return batch


def refresh_batch_of_job(session: Session, job_id: str) -> Batch | None:
    """Refresh the batch a job belongs to, if any (a worker calls this when one of its jobs ends)."""
    batch = session.scalar(select(Batch).join(BatchRequest, BatchRequest.batch_id == Batch.id)
                           .where(BatchRequest.job_id == job_id))
    return refresh(session, batch) if batch is not None else None


def refresh_open_batches(session: Session) -> list[str]:
    """Refresh every open batch (the reaper's pass); returns the ids of those that changed state."""
    changed = []
    for batch in session.scalars(select(Batch).where(Batch.status.in_(OPEN_STATUSES))).all():
        before = batch.status
        if refresh(session, batch).status is not before:
            changed.append(batch.id)
    return changed


def get_batch(session: Session, key: ApiKey, batch_id: str) -> Batch:
    """The caller's batch, refreshed; 404 for another key's batch."""
    return refresh(session, get_owned(session, key, Batch, batch_id, "batch"))


def cancel_batch(session: Session, key: ApiKey, batch_id: str) -> Batch:
    """Stop a batch: its queued jobs are cancelled, running ones finish, then it becomes cancelled."""
    batch = get_batch(session, key, batch_id)
    if batch.status is BatchStatus.cancelling:
        return batch
    if batch.status is not BatchStatus.in_progress or not _move(
            session, batch, BatchStatus.cancelling, cancelling_at=utcnow()):
        raise ApiError(409, f"batch {batch_id} is already {batch.status.value} and cannot be cancelled", "batch_id")
    _cancel_jobs(session, _unfinished_job_ids(session, batch), {JobStatus.queued})
    return refresh(session, batch)


def list_batches(session: Session, key: ApiKey, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    """A page of the caller's batches, newest first, after the batch id `after`; and whether more follow."""
    query = select(Batch).where(Batch.api_key_id == key.id)
    if after:
        anchor = get_batch(session, key, after)
        query = query.where(or_(Batch.created_at < anchor.created_at,
                                and_(Batch.created_at == anchor.created_at, Batch.id < anchor.id)))
    page = list(session.scalars(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)))
    return [refresh(session, batch) for batch in page[:limit]], len(page) > limit
