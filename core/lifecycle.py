"""The one place where job states change: compare-and-set transitions and what follows each one."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from core import queue, streams
from core.job_metrics import JOBS_FINISHED, JOBS_SUBMITTED, record_job_latencies
from core.logging import log_event
from core.models import Job, JobStatus, WebhookDelivery, utcnow

logger = logging.getLogger("pagedserve.jobs")


def transition(
    session: Session, job_id: str, to: JobStatus, allowed_from: set[JobStatus],
    expected: dict[str, Any] | None = None, **fields: Any,
) -> Job | None:
    """Move a job to `to` if it is still in one of `allowed_from` (and has the `expected` column values).

    Commits and returns the job, else None. The UPDATE ... WHERE status IN (...) makes racing writers
    (a cancel and a worker's result) safe: exactly one wins; `expected` (worker_id, attempts) fences off a
    worker whose job was taken away. A final state also records its webhook delivery in the same transaction.
    """
    if to.is_final:
        fields.setdefault("finished_at", utcnow())
    guards = [getattr(Job, column) == value for column, value in (expected or {}).items()]
    stmt = update(Job).where(Job.id == job_id, Job.status.in_(allowed_from), *guards).values(status=to, **fields)
    if session.execute(stmt).rowcount != 1:
        session.rollback()
        return None
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    delivery = None
    if to.is_final and job.webhook_url:
        delivery = WebhookDelivery(job_id=job.id, event=f"job.{to.value}", url=job.webhook_url)
        session.add(delivery)
    session.commit()
    _after_transition(job, delivery)
    return job


def _after_transition(job: Job, delivery: WebhookDelivery | None) -> None:
    # Everything here runs after the commit, so a failure cannot undo the transition; the
    # database row (and the delivery row) stay the source of truth for a reconciler.
    log_event(logger, "job.transition", job_id=job.id, status=job.status.value, attempts=job.attempts)
    if not job.status.is_final:
        return
    JOBS_FINISHED.labels(job.status.value).inc()
    record_job_latencies(job)
    try:
        streams.publish_final(streams.redis_client(), job.id, job.status.value)
        if delivery is not None:
            queue.enqueue_webhook(delivery.id)
        if job.status is JobStatus.cancelled:  # a queued one waits in its key's line: no turn is spent on it
            queue.withdraw_job(job.id, job.priority, job.api_key_id)
    except Exception as exc:  # Redis down: the job's state is committed; delivery rows stay pending.
        logger.warning("job.after_transition_failed job_id=%s error=%r", job.id, exc)


def job_created(job: Job) -> None:
    """Log a new job and hand it to the queue (after its row is committed)."""
    log_event(logger, "job.transition", job_id=job.id, status=job.status.value, attempts=0)
    JOBS_SUBMITTED.inc()
    try:
        queue.enqueue_job(job.id, job.priority, job.api_key_id)
    except Exception as exc:  # Accepted work stays queued in the database; a reconciler re-enqueues it.
        logger.error("job.enqueue_failed job_id=%s error=%r", job.id, exc)
