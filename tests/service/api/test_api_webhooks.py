"""Webhook deliveries: created with a job's final state, signed, retried after failures, every attempt recorded."""

from __future__ import annotations

import json

import redis
from fastapi.testclient import TestClient
from tests.service.receiver import WebhookReceiver

from api.db import session_factory
from api.lifecycle import transition
from api.models import JobStatus
from api.settings import Settings
from worker import webhooks


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


def test_delivery_is_signed_over_timestamp_and_body(
    client: TestClient, auth_headers: dict[str, str], webhook_receiver: WebhookReceiver
) -> None:
    job_id = _submit(client, auth_headers, webhook_receiver.url)
    webhooks.deliver(_finish(job_id))
    (request,) = webhook_receiver.received
    timestamp, signature = request.headers["X-Pagedserve-Timestamp"], request.headers["X-Pagedserve-Signature"]
    assert webhooks.verify("test-secret", timestamp, request.body, signature)
    assert not webhooks.verify("other-secret", timestamp, request.body, signature)
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
        webhooks.deliver(delivery_id)
    (delivery,) = client.get(f"/v1/jobs/{job_id}/webhooks", headers=auth_headers).json()
    assert delivery["status"] == "failed" and delivery["num_attempts"] == service_settings.webhook_max_attempts
    assert all(a["error"] for a in delivery["attempts"])


def test_backoff_doubles_each_attempt(service_settings: Settings) -> None:
    assert [webhooks.backoff_s(n) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]
