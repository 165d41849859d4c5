"""Recovery of lost work, run in every worker, one at a time under a Redis lock.

The reaper puts jobs held by a dead worker (heartbeat expired) back on the queue; the reconciler
re-enqueues queued jobs that lost their entry in fair share's lines or whose level lost broker messages
(Redis restarted empty, a worker died between taking an entry and claiming its job), and pending webhook
deliveries whose broker message was lost. A duplicate message is harmless: a job starts
only through the compare-and-set claim, so at most one run of it is live. The pass also moves open
batches on: it expires those past their completion window and finalizes those a worker did not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from datetime import timedelta

from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session

from core import batch_progress, fair_queue, queue, streams
from core.db import session_factory
from core.lifecycle import transition
from core.logging import log_event
from core.models import DeliveryStatus, Job, JobStatus, WebhookDelivery, utcnow
from core.settings import get_settings
from worker import heartbeat

logger = logging.getLogger("pagedserve.reaper")


def _claim_requeue(kind: str, item_id: str) -> bool:
    """Whether this item may be re-enqueued now: at most once per grace period, whoever reconciles."""
    grace_ms = int(get_settings().reconcile_grace_s * 1000)
    return bool(streams.redis_client().set(streams.key("requeued", kind, item_id), "1", nx=True, px=grace_ms))


class Reaper:
    """One worker's recovery loop; `run_once` is a whole pass (tests call it directly)."""

    def __init__(self) -> None:
        self._missing_since: dict[str, float] = {}  # worker id → when this reaper first saw its heartbeat gone
        self._next_lost_jobs_look = 0.0  # monotonic time of the next look for lost jobs
        self._stopping = threading.Event()

    def start(self) -> Reaper:
        """Run passes every reaper_interval_s on a daemon thread until stopped."""
        threading.Thread(target=self._loop, name="reaper", daemon=True).start()
        return self

    def stop(self) -> None:
        """End the loop after the current pass."""
        self._stopping.set()

    def _loop(self) -> None:
        while not self._stopping.wait(get_settings().reaper_interval_s):
            try:
                heartbeat.beat()  # a second beat source, independent of the engine thread's pace
                if self._hold_lock():
                    self.run_once()
            except Exception as exc:  # Redis or the store down: try again next interval
                log_event(logger, "reaper.pass_failed", error=repr(exc))

    def _hold_lock(self) -> bool:
        """Take or keep the reaper lock; the holder keeps it while alive, another takes over after it dies."""
        client = streams.redis_client()
        lock, me = streams.key("reaper", "lock"), heartbeat.worker_id()
        ttl_ms = int(get_settings().reaper_interval_s * 3000)
        if client.set(lock, me, nx=True, px=ttl_ms) or client.get(lock) == me:
            client.pexpire(lock, ttl_ms)
            return True
        return False

    def run_once(self) -> dict[str, list[str]]:
        """One pass: requeue dead workers' jobs, re-enqueue lost jobs and deliveries, refresh batches; returns ids."""
        with session_factory()() as session:
            return {
                "requeued": self.requeue_dead_workers_jobs(session),
                "reenqueued": reenqueue_lost_jobs(session) if self._lost_jobs_look_due() else [],
                "redelivered": reenqueue_overdue_deliveries(session),
                "batches": batch_progress.refresh_open_batches(session),  # expiries, and finalizations no worker made
            }

    def _lost_jobs_look_due(self) -> bool:
        # A look reads every job queued longer than the grace period (tens of thousands behind a backlog), and a lost
        # job waits that long before it counts as lost anyway: look every third of it, not on every pass.
        now = time.monotonic()
        if now < self._next_lost_jobs_look:
            return False
        self._next_lost_jobs_look = now + get_settings().reconcile_grace_s / 3
        return True

    def _dead_workers(self, worker_ids: set[str]) -> set[str]:
        # Dead = heartbeat missing on two passes at least one beat interval apart, so a Redis restart that
        # wiped every heartbeat does not make live workers look dead before they beat again.
        now, confirm_s = time.monotonic(), get_settings().reaper_interval_s
        alive = {w for w in worker_ids if heartbeat.is_alive(w)}
        self._missing_since = {w: self._missing_since.get(w, now) for w in worker_ids - alive}
        return {w for w, since in self._missing_since.items() if now - since >= confirm_s}

    def requeue_dead_workers_jobs(self, session: Session) -> list[str]:
        """Put running jobs whose worker is dead back to queued and on the queue."""
        running = session.execute(select(Job.id, Job.worker_id).where(Job.status == JobStatus.running)).all()
        dead = self._dead_workers({worker for _, worker in running if worker})
        requeued = []
        for job_id, worker in running:
            if worker not in dead:
                continue
            job = transition(session, job_id, JobStatus.queued, {JobStatus.running}, {"worker_id": worker},
                             worker_id=None, started_at=None, first_token_at=None)
            if job is not None:
                log_event(logger, "job.requeued", job_id=job_id, dead_worker=worker, attempts=job.attempts)
                queue.enqueue_job(job_id, job.priority, job.api_key_id)
                requeued.append(job_id)
        return requeued


def reenqueue_lost_jobs(session: Session) -> list[str]:
    """Re-enqueue jobs queued longer than the grace period that a worker could miss: those with no entry in
    their key's line (a worker died between taking the entry and claiming the job, or Redis lost it), and as many
    waiting ones as a level has entries beyond its messages (the broker lost messages)."""
    cutoff = utcnow() - timedelta(seconds=get_settings().reconcile_grace_s)
    stale = session.execute(select(Job.id, Job.priority, Job.api_key_id).where(
        Job.status == JobStatus.queued, Job.created_at < cutoff).order_by(Job.created_at, Job.id)).all()
    if not stale:
        return []
    waiting = fair_queue.waiting((queue.broker_level(priority), key, job_id) for job_id, priority, key in stale)
    lost = [row for row in stale if row.id not in waiting]
    for level, rows in _by_level(row for row in stale if row.id in waiting).items():
        lost += rows[:_messages_short(level)]
    reenqueued = [row for row in lost if _claim_requeue("job", row.id)]
    for job_id, priority, api_key_id in reenqueued:
        log_event(logger, "job.reenqueued", job_id=job_id, reason="queued in the store, missing from the queue")
        queue.enqueue_job(job_id, priority, api_key_id)
    return [row.id for row in reenqueued]


def _by_level(rows: Iterable[Row[tuple[str, int, str]]]) -> dict[int, list[Row[tuple[str, int, str]]]]:
    levels: dict[int, list[Row[tuple[str, int, str]]]] = {}
    for row in rows:
        levels.setdefault(queue.broker_level(row.priority), []).append(row)
    return levels


def _messages_short(level: int) -> int:
    """How many more entries wait at a level than messages wait in the broker there (0 when none are missing)."""
    messages = streams.redis_client().llen(queue.broker_queue_keys(queue.JOBS_QUEUE)[level])
    return max(0, fair_queue.waiting_count(level) - messages)


def reenqueue_overdue_deliveries(session: Session) -> list[str]:
    """Re-enqueue pending webhook deliveries whose next attempt (or lapsed claim) is overdue by the grace period."""
    cutoff = utcnow() - timedelta(seconds=get_settings().reconcile_grace_s)
    due_at = func.coalesce(WebhookDelivery.next_attempt_at, WebhookDelivery.created_at)
    overdue = session.execute(select(WebhookDelivery.id, WebhookDelivery.job_id).where(
        WebhookDelivery.status == DeliveryStatus.pending, due_at < cutoff)).all()
    redelivered = []
    for delivery_id, job_id in overdue:
        if _claim_requeue("delivery", delivery_id):
            log_event(logger, "webhook.reenqueued", delivery_id=delivery_id, job_id=job_id)
            queue.enqueue_webhook(delivery_id)
            redelivered.append(delivery_id)
    return redelivered
