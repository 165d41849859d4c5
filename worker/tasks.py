"""Celery tasks: each takes an id and does its work against the store; the engine lives in the engine service."""

from __future__ import annotations

import logging

from celery import shared_task
from celery.exceptions import Reject

from core import batch_progress
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
def run_job(job_id: str) -> None:
    """Run one job in this process's engine service."""
    if drain.draining():  # a message taken while draining goes back to the broker untouched, for another worker
        raise Reject("worker shutting down", requeue=True)
    try:
        run_job_in_engine(job_id, engine_service(), sampling_params_class())
    except Exception as exc:  # record the failure rather than leave the job running forever
        logger.exception("job.failed_unexpectedly job_id=%s", job_id)
        with session_factory()() as session:
            transition(session, job_id, JobStatus.failed, {JobStatus.running}, {"worker_id": heartbeat.worker_id()},
                       error=f"internal error: {exc!r}")
    _refresh_batch_of(job_id)


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
