"""Webhook deliveries on threads of their own, apart from the job slots: a receiver that never answers holds a
delivery thread for its deadline, never a slot an engine job needs, and one API key's deliveries take at most
`webhook_concurrency_per_key` threads (fewer than all). A key's next waiting delivery joins the back of the pool's
queue when one of its attempts ends, so another tenant's delivery waits at most about one attempt's deadline
behind slow receivers, never behind their backlogs.

The Celery task only hands the delivery id over, so its message is acknowledged before the attempt: a delivery a
dying worker held (claimed or still waiting here) is pending and overdue in the store, and the reaper's reconcile
pass re-enqueues it (`worker.reaper.reenqueue_overdue_deliveries`)."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import select

from core.db import session_factory
from core.models import Job, WebhookDelivery
from core.settings import get_settings
from worker import webhooks

logger = logging.getLogger("pagedserve.worker")


class DeliveryPool:
    """Runs webhook attempts on `threads` threads, at most `per_key` at once for one API key; the others of that
    key wait here, in order, for one of its attempts to end."""

    def __init__(self, threads: int, per_key: int) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="webhook")
        self._per_key = per_key
        self._lock = threading.Lock()
        self._running: dict[str, int] = defaultdict(int)  # API key id -> its attempts given to the executor
        self._waiting: dict[str, deque[str]] = defaultdict(deque)  # API key id -> its deliveries over the cap
        # the ids in _waiting: the reaper re-enqueues a delivery that waits past the reconcile grace, and that copy
        # is dropped rather than queued twice (a copy of a running one runs: its claim finds the attempt taken)
        self._waiting_ids: set[str] = set()
        self._stopping = False

    def submit(self, delivery_id: str) -> None:
        """Queue one attempt of a delivery (it is skipped when not due, as `webhooks.deliver` decides)."""
        key_id = _owner(delivery_id)
        if key_id is None:
            return  # no such delivery (its job was deleted with it)
        with self._lock:
            if delivery_id in self._waiting_ids or self._stopping:
                return
            if self._running[key_id] >= self._per_key:
                self._waiting[key_id].append(delivery_id)
                self._waiting_ids.add(delivery_id)
                return
            self._running[key_id] += 1
        self._executor.submit(self._attempt, key_id, delivery_id)

    def _attempt(self, key_id: str, delivery_id: str) -> None:
        try:
            webhooks.deliver(delivery_id)
        except Exception:  # the delivery stays pending; the reaper re-enqueues it once overdue
            logger.exception("webhook.attempt_failed delivery_id=%s", delivery_id)
        with self._lock:  # the key's next waiting delivery takes this attempt's place, at the back of the queue
            waiting = self._waiting.get(key_id)
            if waiting and not self._stopping:
                following = waiting.popleft()
                self._waiting_ids.discard(following)
                self._executor.submit(self._attempt, key_id, following)
                return
            self._waiting.pop(key_id, None)
            self._running[key_id] -= 1
            if not self._running[key_id]:
                del self._running[key_id]

    def shutdown(self) -> None:
        """Finish the attempts in progress (each within its deadline); drop the queued and waiting ones, which stay
        pending in the store for the reaper."""
        with self._lock:
            self._stopping = True
        self._executor.shutdown(wait=True, cancel_futures=True)


def _owner(delivery_id: str) -> str | None:
    """The id of the API key whose job the delivery reports, or None without such a delivery."""
    with session_factory()() as session:
        return session.scalar(select(Job.api_key_id).join(WebhookDelivery, WebhookDelivery.job_id == Job.id)
                              .where(WebhookDelivery.id == delivery_id))


_pool: DeliveryPool | None = None
_pool_lock = threading.Lock()


def delivery_pool() -> DeliveryPool:
    """This process's delivery pool, sized by the settings on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            settings = get_settings()
            _pool = DeliveryPool(settings.webhook_concurrency, settings.webhook_concurrency_per_key)
        return _pool


def shutdown_delivery_pool() -> None:
    """Stop this process's delivery pool, if one was started (see `DeliveryPool.shutdown`)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown()
