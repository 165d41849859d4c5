"""The reconciler re-enqueues webhook deliveries that are overdue (their message was lost), once per grace period."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from core import queue, streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import DeliveryStatus, JobStatus, WebhookDelivery, utcnow
from core.settings import Settings
from worker.reaper import reenqueue_overdue_deliveries


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """The query runs on both stores elsewhere; SQLite is enough here."""
    return sqlite_url


def _pending_delivery(settings: Settings, headers: dict[str, str]) -> str:
    body = {"prompt": "hook me", "webhook_url": "http://127.0.0.1:9/hook"}
    job_id = TestClient(create_app(settings)).post("/v1/jobs", json=body, headers=headers).json()["id"]
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
        job = transition(session, job_id, JobStatus.succeeded, {JobStatus.running}, output=[], completion_tokens=0)
        assert job is not None
        return job.deliveries[0].id


def _set(delivery_id: str, **values: object) -> None:
    with session_factory()() as session:
        session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(**values))
        session.commit()


def _messages_for(delivery_ids: list[str]) -> list[str]:
    """The delivery ids named by webhook messages waiting in the broker, one entry per message."""
    client = streams.redis_client()
    raw = [m for key in queue.broker_queue_keys(queue.WEBHOOKS_QUEUE) for m in client.lrange(key, 0, -1)]
    return [delivery_id for message in raw for delivery_id in delivery_ids if delivery_id in message]


def test_only_overdue_pending_deliveries_are_reenqueued_and_only_once(
    service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    overdue, retry_overdue, recent, retry_later, done = (
        _pending_delivery(service_settings, auth_headers) for _ in range(5))
    client = streams.redis_client()
    client.delete(*queue.broker_queue_keys(queue.WEBHOOKS_QUEUE))  # every message lost
    long_ago = utcnow() - timedelta(seconds=service_settings.reconcile_grace_s + 60)
    _set(overdue, created_at=long_ago)
    _set(retry_overdue, created_at=long_ago, next_attempt_at=long_ago)
    _set(retry_later, created_at=long_ago, next_attempt_at=utcnow() + timedelta(hours=1))
    _set(done, created_at=long_ago, status=DeliveryStatus.delivered)
    with session_factory()() as session:
        assert sorted(reenqueue_overdue_deliveries(session)) == sorted([overdue, retry_overdue])
        assert reenqueue_overdue_deliveries(session) == []  # claimed for this grace period
    ids = [overdue, retry_overdue, recent, retry_later, done]
    assert sorted(_messages_for(ids)) == sorted([overdue, retry_overdue])
