"""Worker drain: on SIGTERM (Celery's warm shutdown) running jobs get `shutdown_grace_s` to finish, then are requeued.

Celery stops taking messages at the signal and waits for the running tasks; the process's cancel watcher
(worker/cancel_watch.py) asks `overdue()` on each pass and, once the grace period is over, aborts every running
job's engine request; each job's runner then hands its job back to the queue through `requeue`, so another
worker runs it from the start. The runner returns normally, and Celery acks the old message: the job is on
the queue exactly once. A message the worker still takes while draining is rejected back to the broker
before its job is claimed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from core import queue
from core.db import session_factory
from core.lifecycle import transition
from core.logging import log_event
from core.models import Job, JobStatus
from core.settings import get_settings

logger = logging.getLogger("pagedserve.worker")
_deadline_s: float | None = None  # time.monotonic() after which running jobs are requeued; None: not draining


def begin(**_signal_kwargs: Any) -> None:
    """Start draining (a Celery `worker_shutting_down` receiver): jobs may run for shutdown_grace_s more."""
    global _deadline_s
    grace_s = get_settings().shutdown_grace_s
    if _deadline_s is None:  # a second SIGTERM does not extend the grace period (runs in the signal handler)
        _deadline_s = time.monotonic() + grace_s
    log_event(logger, "worker.draining", grace_s=grace_s)


def draining() -> bool:
    """Whether this worker has been told to shut down."""
    return _deadline_s is not None


def overdue() -> bool:
    """Whether this worker is draining and its grace period is over."""
    return _deadline_s is not None and time.monotonic() >= _deadline_s


def requeue(job: Job) -> None:
    """Hand a job this worker is running back to the queue (fenced: a job no longer this run's is left alone)."""
    expected = {"worker_id": job.worker_id, "attempts": job.attempts}
    with session_factory()() as session:
        requeued = transition(session, job.id, JobStatus.queued, {JobStatus.running}, expected,
                              worker_id=None, started_at=None, first_token_at=None)
    if requeued is not None:
        log_event(logger, "job.requeued", job_id=job.id, reason="worker shutting down", attempts=job.attempts)
        queue.enqueue_job(job.id, job.priority, job.api_key_id)
