"""The delivery pool: webhook attempts on threads of their own, at most `per_key` of one API key at once, so one
tenant's receiver that never answers holds up no other tenant's deliveries (and, in a worker, no job slot)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.app import create_app
from core.db import session_factory
from core.lifecycle import transition
from core.models import DeliveryStatus, JobStatus, WebhookDelivery
from core.settings import Settings
from tests.service.procs import wait_until
from tests.service.receiver import WebhookReceiver
from worker.delivery_pool import DeliveryPool


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """The pool's one query runs on both stores; SQLite is enough here."""
    return sqlite_url


@pytest.fixture
def held_receiver() -> Iterator[WebhookReceiver]:
    """A receiver that answers nothing until released."""
    receiver = WebhookReceiver(held=True).start()
    yield receiver
    receiver.stop()


def _finished_job_delivery(settings: Settings, headers: dict[str, str], url: str) -> str:
    """A succeeded job's pending webhook delivery to `url`."""
    job_id = TestClient(create_app(settings)).post("/v1/jobs", json={"prompt": "hook", "webhook_url": url},
                                                   headers=headers).json()["id"]
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
        job = transition(session, job_id, JobStatus.succeeded, {JobStatus.running}, output=[], completion_tokens=0)
        assert job is not None
        return job.deliveries[0].id


def _statuses(delivery_ids: list[str]) -> list[DeliveryStatus]:
    with session_factory()() as session:
        return list(session.scalars(select(WebhookDelivery.status).where(WebhookDelivery.id.in_(delivery_ids))))


def test_one_keys_receiver_that_never_answers_takes_at_most_its_share_of_threads(
    service_settings: Settings, new_auth_headers: Callable[..., dict[str, str]], held_receiver: WebhookReceiver,
    webhook_receiver: WebhookReceiver,
) -> None:
    slow_tenant, other_tenant = new_auth_headers("slow"), new_auth_headers("other")
    held = [_finished_job_delivery(service_settings, slow_tenant, held_receiver.url) for _ in range(6)]
    other = _finished_job_delivery(service_settings, other_tenant, webhook_receiver.url)
    pool = DeliveryPool(threads=3, per_key=2)
    try:
        for delivery_id in [*held, held[-1]]:  # the repeat is the reaper's copy of a waiting delivery
            pool.submit(delivery_id)
        wait_until(lambda: len(held_receiver.received) == 2, 30, "two held attempts")
        pool.submit(other)  # its own thread, while the slow tenant's two attempts hang
        wait_until(lambda: _statuses([other]) == [DeliveryStatus.delivered], 30, "the other tenant's delivery")
        assert held_receiver.most_at_once == 2 and len(held_receiver.received) == 2
        held_receiver.release()
        wait_until(lambda: set(_statuses(held)) == {DeliveryStatus.delivered}, 30, "the held deliveries")
    finally:
        held_receiver.release()
        pool.shutdown()
    assert held_receiver.most_at_once == 2 and len(held_receiver.received) == 6  # one attempt each, in turn


def test_a_waiting_delivery_goes_behind_other_keys_work_and_shutdown_drops_the_waiting_ones(
    service_settings: Settings, new_auth_headers: Callable[..., dict[str, str]], held_receiver: WebhookReceiver,
    webhook_receiver: WebhookReceiver,
) -> None:
    slow_tenant, other_tenant = new_auth_headers("slow-2"), new_auth_headers("other-2")
    held = [_finished_job_delivery(service_settings, slow_tenant, held_receiver.url) for _ in range(4)]
    others = [_finished_job_delivery(service_settings, other_tenant, webhook_receiver.url) for _ in range(3)]
    pool = DeliveryPool(threads=2, per_key=1)
    for delivery_id in held:
        pool.submit(delivery_id)
    wait_until(lambda: len(held_receiver.received) == 1, 30, "the slow tenant's first attempt")
    for delivery_id in others:  # one free thread: the other tenant's deliveries go through it, one after another
        pool.submit(delivery_id)
    wait_until(lambda: set(_statuses(others)) == {DeliveryStatus.delivered}, 30, "the other tenant's deliveries")
    held_receiver.release()
    pool.shutdown()  # the slow tenant's waiting deliveries are dropped (pending, for the reaper), not run
    assert len(held_receiver.received) < len(held) and DeliveryStatus.pending in _statuses(held)
