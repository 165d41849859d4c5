"""How an OpenAI batch moves on once it runs: expiry, finalizing, its output files, the end of a cancel.

A batch moves on through `refresh`: when one of its jobs ends (the worker), on every reaper pass, and
when the API reads it. Each move is a compare-and-set on its status, so racing callers move it once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core import streams
from core.batch_output import output_files
from core.lifecycle import transition
from core.models import Batch, BatchRequest, BatchStatus, Job, JobStatus, utcnow
from core.settings import get_settings
from core.stored_files import BATCH_OUTPUT, store_file

OPEN_STATUSES = (BatchStatus.in_progress, BatchStatus.finalizing, BatchStatus.cancelling)
UNFINISHED_JOBS = (JobStatus.queued, JobStatus.running)
CANCELLED_LINE = {"code": "batch_cancelled", "message": "The batch was cancelled before this request finished."}
EXPIRED_LINE = {"code": "batch_expired",
                "message": "This request could not be executed before the completion window expired."}


def unfinished_job_ids(session: Session, batch: Batch, limit: int | None = None) -> list[str]:
    """Ids of the batch's jobs that are not final yet (at most `limit`)."""
    # newest lines first: they run last, so while a batch runs the first row read is already unfinished
    query = (select(Job.id).join(BatchRequest, BatchRequest.job_id == Job.id)
             .where(BatchRequest.batch_id == batch.id, Job.status.in_(UNFINISHED_JOBS))
             .order_by(BatchRequest.line_number.desc()).limit(limit))
    return list(session.scalars(query))


def move_batch(session: Session, batch: Batch, to: BatchStatus, **values: Any) -> bool:
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
    move_batch(session, batch, to, **{f"{to.value}_at": utcnow()},
               output_file_id=output_file.id if output_file else None,
               error_file_id=error_file.id if error_file else None)


def cancel_jobs(session: Session, job_ids: list[str], allowed_from: set[JobStatus]) -> None:
    """Cancel these jobs if still in `allowed_from`; a running one is aborted by its worker."""
    for job_id in job_ids:
        if transition(session, job_id, JobStatus.cancelled, allowed_from) is not None:
            streams.request_cancel(streams.redis_client(), job_id)


def _expire(session: Session, batch: Batch) -> None:
    """Past its window: cancel what has not finished, then close the batch as expired with what did (partial files)."""
    cancel_jobs(session, unfinished_job_ids(session, batch), set(UNFINISHED_JOBS))
    _close(session, batch, BatchStatus.expired, EXPIRED_LINE)


def _finalizing_is_stale(batch: Batch) -> bool:
    # finalizing outlives the one call that writes the files only when that caller died: take over after a grace
    grace = timedelta(seconds=get_settings().reconcile_grace_s)
    return batch.finalizing_at is not None and utcnow() - batch.finalizing_at > grace


def refresh(session: Session, batch: Batch) -> Batch:
    """Move an open batch on: expire it past its window, finalize it once its jobs are all final."""
    if batch.status is BatchStatus.in_progress and batch.expires_at is not None and utcnow() >= batch.expires_at:
        _expire(session, batch)
    elif batch.status is BatchStatus.in_progress and not unfinished_job_ids(session, batch, limit=1):
        if move_batch(session, batch, BatchStatus.finalizing, finalizing_at=utcnow()):
            _close(session, batch, BatchStatus.completed, CANCELLED_LINE)
    elif batch.status is BatchStatus.cancelling and not unfinished_job_ids(session, batch, limit=1):
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
