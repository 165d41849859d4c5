"""Webhook deliveries: created with a job's final state, signed with the job's key's secret, retried after
failures, claimed once per attempt, sent only to the checked address, and cut off by a bound and a deadline."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.auth import find_api_key
from core.db import session_factory
from core.lifecycle import transition
from core.models import JobStatus, WebhookDelivery
from core.settings import Settings, configure
from tests.service.raw_receiver import RawReceiver, drip, endless_body, held_until_released
from tests.service.receiver import WebhookReceiver
from worker import webhooks

REBINDING_HOST = "hooks.rebind.test"


def _submit(client: TestClient, headers: dict[str, str], url: str) -> str:
    response = client.post("/v1/jobs", json={"prompt": "hook me", "webhook_url": url}, headers=headers)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _finish(job_id: str, to: JobStatus = JobStatus.succeeded) -> str:
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
        job = transition(session, job_id, to, {JobStatus.running}, output=[], completion_tokens=0)
        assert job is not None
        return job.deliveries[0].id


def _delivery(client: TestClient, headers: dict[str, str], url: str) -> str:
    """A pending delivery of a finished job of this key, to url."""
    return _finish(_submit(client, headers, url))


def _backoff_passes(delivery_id: str) -> None:
    """Make a delivery's scheduled retry due now, as if its backoff had passed."""
    with session_factory()() as session:
        session.execute(update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(next_attempt_at=None))
        session.commit()


def _attempts(client: TestClient, headers: dict[str, str], delivery_id: str) -> list[dict[str, Any]]:
    deliveries = client.get("/v1/jobs", headers=headers).json()["data"]
    for job in deliveries:
        for delivery in client.get(f"/v1/jobs/{job['id']}/webhooks", headers=headers).json():
            if delivery["id"] == delivery_id:
                return list(delivery["attempts"])
    raise AssertionError(f"no delivery {delivery_id}")


def _secret(headers: dict[str, str]) -> str:
    with session_factory()() as session:
        key = find_api_key(session, headers["Authorization"].removeprefix("Bearer "))
        assert key is not None
        return key.webhook_secret


def test_final_state_creates_one_delivery_and_queues_it(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings, webhook_receiver: WebhookReceiver
) -> None:
    job_id = _submit(client, auth_headers, webhook_receiver.url)
    delivery_id = _finish(job_id)
    queued = redis.Redis.from_url(service_settings.redis_url).lrange(
        f"{service_settings.redis_key_prefix}celery:pagedserve.webhooks", 0, -1
    )
    assert any(delivery_id.encode() in message for message in queued)
    deliveries = client.get(f"/v1/jobs/{job_id}/webhooks", headers=auth_headers).json()
    assert [(d["id"], d["event"], d["status"]) for d in deliveries] == [(delivery_id, "job.succeeded", "pending")]


def test_delivery_is_signed_with_its_keys_secret_over_timestamp_and_body(
    client: TestClient, auth_headers: dict[str, str], new_auth_headers: Any, webhook_receiver: WebhookReceiver
) -> None:
    job_id = _submit(client, auth_headers, webhook_receiver.url)
    webhooks.deliver(_finish(job_id))
    (request,) = webhook_receiver.received
    timestamp, signature = request.headers["X-Pagedserve-Timestamp"], request.headers["X-Pagedserve-Signature"]
    assert webhooks.verify(_secret(auth_headers), timestamp, request.body, signature)
    assert not webhooks.verify(_secret(new_auth_headers("another tenant")), timestamp, request.body, signature)
    payload = json.loads(request.body)
    assert payload["event"] == "job.succeeded" and payload["job"]["id"] == job_id
    assert payload["job"]["status"] == "succeeded"


def test_failed_attempts_are_recorded_and_retried_until_delivered(
    client: TestClient, auth_headers: dict[str, str], webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [500, 503]
    job_id = _submit(client, auth_headers, webhook_receiver.url)
    delivery_id = _finish(job_id, JobStatus.failed)
    for _ in range(3):
        _backoff_passes(delivery_id)
        webhooks.deliver(delivery_id)
    (delivery,) = client.get(f"/v1/jobs/{job_id}/webhooks", headers=auth_headers).json()
    assert delivery["status"] == "delivered" and delivery["num_attempts"] == 3
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 503, 200]
    assert len({r.headers["X-Pagedserve-Delivery"] for r in webhook_receiver.received}) == 1


def test_delivery_fails_after_the_last_attempt(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    job_id = _submit(client, auth_headers, "http://127.0.0.1:9/nobody-listens")
    delivery_id = _finish(job_id)
    for _ in range(service_settings.webhook_max_attempts + 1):
        _backoff_passes(delivery_id)
        webhooks.deliver(delivery_id)
    (delivery,) = client.get(f"/v1/jobs/{job_id}/webhooks", headers=auth_headers).json()
    assert delivery["status"] == "failed" and delivery["num_attempts"] == service_settings.webhook_max_attempts
    assert all(a["error"] for a in delivery["attempts"])


def test_backoff_doubles_each_attempt(service_settings: Settings) -> None:
    assert [webhooks.backoff_s(n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]


def test_a_duplicated_message_does_not_post_while_the_attempt_is_in_flight(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    receiver = RawReceiver(held_until_released).start()
    delivery_id = _delivery(client, auth_headers, receiver.url)
    first = threading.Thread(target=webhooks.deliver, args=(delivery_id,))
    first.start()
    assert receiver.request_arrived.wait(timeout=30)
    webhooks.deliver(delivery_id)  # the same message again, while the first copy waits for the receiver
    receiver.release.set()
    first.join()
    receiver.stop()
    assert receiver.num_requests == 1
    assert [a["status_code"] for a in _attempts(client, auth_headers, delivery_id)] == [200]


def test_a_duplicated_message_does_not_post_before_the_retry_is_due(
    client: TestClient, auth_headers: dict[str, str], webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [500]
    delivery_id = _delivery(client, auth_headers, webhook_receiver.url)
    webhooks.deliver(delivery_id)
    webhooks.deliver(delivery_id)  # redelivered by the broker right after the failed attempt
    assert len(webhook_receiver.received) == 1
    _backoff_passes(delivery_id)
    webhooks.deliver(delivery_id)
    assert [a["status_code"] for a in _attempts(client, auth_headers, delivery_id)] == [500, 200]


@pytest.fixture
def rebinding_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """REBINDING_HOST resolves to 127.0.0.1 on the next lookup and to 127.0.0.2 on every one after; yields the
    answers."""
    real_getaddrinfo, answers = socket.getaddrinfo, []

    def rebinding_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host != REBINDING_HOST:
            return real_getaddrinfo(host, *args, **kwargs)
        answers.append("127.0.0.2" if answers else "127.0.0.1")
        return real_getaddrinfo(answers[-1], *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_getaddrinfo)
    yield answers


def test_delivery_connects_to_the_checked_address_when_the_name_rebinds(
    client: TestClient, auth_headers: dict[str, str], rebinding_dns: list[str]
) -> None:
    checked = WebhookReceiver().start()
    assert checked.server is not None
    port = checked.server.server_address[1]
    rebound = WebhookReceiver(host="127.0.0.2", port=port).start()  # where a second lookup would lead
    delivery_id = _delivery(client, auth_headers, f"http://{REBINDING_HOST}:{port}/hook")
    rebinding_dns.clear()  # the API's check at submission looked the name up too
    webhooks.deliver(delivery_id)
    checked.stop()
    rebound.stop()
    assert rebound.received == [] and len(checked.received) == 1
    assert checked.received[0].headers["Host"] == f"{REBINDING_HOST}:{port}"


def test_delivery_refuses_a_target_that_resolves_to_a_private_address_at_delivery_time(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings, rebinding_dns: list[str]
) -> None:
    receiver = WebhookReceiver().start()
    assert receiver.server is not None
    delivery_id = _delivery(client, auth_headers, f"http://{REBINDING_HOST}:{receiver.server.server_address[1]}/")
    configure(service_settings.model_copy(update={"webhook_allow_private": False}))
    try:
        webhooks.deliver(delivery_id)
    finally:
        configure(service_settings)
    receiver.stop()
    assert receiver.received == []
    (attempt,) = _attempts(client, auth_headers, delivery_id)
    assert f"{REBINDING_HOST!r} resolves to non-public address" in attempt["error"]


def test_an_endless_response_body_is_read_only_up_to_the_bound(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    receiver = RawReceiver(endless_body).start()
    delivery_id = _delivery(client, auth_headers, receiver.url)
    webhooks.deliver(delivery_id)
    receiver.stop()
    assert [a["status_code"] for a in _attempts(client, auth_headers, delivery_id)] == [200]
    # what the kernel buffers on loopback plus the bound; the receiver would go on to 256 MiB
    assert receiver.hung_up and receiver.sent_bytes < 32 << 20


@pytest.mark.timeout(120)
def test_a_drip_fed_response_is_cut_off_by_the_attempt_deadline(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    receiver = RawReceiver(drip).start()
    delivery_id = _delivery(client, auth_headers, receiver.url)
    configure(service_settings.model_copy(update={"webhook_timeout_s": 1.0}))  # each byte comes well within 1 s
    try:
        webhooks.deliver(delivery_id)
    finally:
        configure(service_settings)
    receiver.stop()
    (attempt,) = _attempts(client, auth_headers, delivery_id)
    assert attempt["status_code"] is None and "1.0 s deadline" in attempt["error"]
    assert receiver.hung_up
