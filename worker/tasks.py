"""Celery tasks: each takes an id and does its work against the store; the engine lives in the engine service."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from celery import shared_task
from celery.exceptions import Reject

from core import batch_progress, fair_queue
from core.db import session_factory
from core.lifecycle import transition
from core.logging import log_event
from core.models import JobStatus
from core.queue import DELIVER_WEBHOOK_TASK, RUN_JOB_TASK
from worker import drain, heartbeat
from worker.delivery_pool import delivery_pool
from worker.runner import run_job as run_job_in_engine
from worker.service import engine_service, sampling_params_class

logger = logging.getLogger("pagedserve.worker")


@shared_task(name=RUN_JOB_TASK)
def run_job(job_id: str, level: int | None = None) -> None:
    """Run one job at the message's level in this process's engine service: the first that fair share pops and
    this worker claims (entries of jobs no longer queued are passed over), else the message's own job."""
    if drain.draining():  # a message taken while draining goes back to the broker untouched, for another worker
        raise Reject("worker shutting down", requeue=True)
    for candidate in _candidates(job_id, level):
        ran = _run(candidate)
        _refresh_batch_of(candidate)
        if ran:
            return


def _candidates(job_id: str, level: int | None) -> Iterator[str]:
    # a message queued before fair share (no level) runs its own job only
    while level is not None and (popped := fair_queue.pop(level)) is not None:
        yield popped
    yield job_id


def _run(job_id: str) -> bool:
    """Run a job if it can be claimed; True once it was claimed (or the attempt failed, which ends the message)."""
    try:
        return run_job_in_engine(job_id, engine_service(), sampling_params_class())
    except Exception as exc:  # record the failure rather than leave the job running forever
        logger.exception("job.failed_unexpectedly job_id=%s", job_id)
        with session_factory()() as session:
            transition(session, job_id, JobStatus.failed, {JobStatus.running}, {"worker_id": heartbeat.worker_id()},
                       error=f"internal error: {exc!r}")
        return True


def _refresh_batch_of(job_id: str) -> None:
    """Finalize the job's batch if this was its last job, so a batch completes without being read."""
    try:
        with session_factory()() as session:
            batch_progress.refresh_batch_of_job(session, job_id)
    except Exception as exc:  # the job's result is recorded; the reaper's pass finalizes the batch instead
        log_event(logger, "batch.refresh_failed", job_id=job_id, error=repr(exc))


@shared_task(name=DELIVER_WEBHOOK_TASK)
def deliver_webhook(delivery_id: str) -> None:
    """Hand one attempt of a webhook delivery to the delivery pool (never a job slot's thread)."""
    delivery_pool().submit(delivery_id)
