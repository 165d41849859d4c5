"""DELETE /v1/jobs/{id} and DELETE /v1/responses/{id}: a finished job goes for good, with its webhook deliveries and
its Redis streams; a job still queued or running, another key's, and a batch's stay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import delete, select

from api import jobs
from api.errors import ApiError
from api.job_follow import DeletedEvent, FinalEvent, follow_final, follow_job
from core import streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import BatchRequest, Job, JobStatus, WebhookAttempt, WebhookDelivery
from core.settings import Settings
from worker import webhooks


def _submit(client: TestClient, headers: dict[str, str], **body: Any) -> str:
    response = client.post("/v1/jobs", json={"prompt": "delete me", "max_tokens": 2, **body}, headers=headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _finish(job_id: str) -> None:
    """Record a job's run as a worker does, to success, and publish its final event."""
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
        assert transition(session, job_id, JobStatus.succeeded, {JobStatus.running}, output=[],
                          completion_tokens=0) is not None
    streams.publish_final(streams.redis_client(), job_id, "succeeded")


def _stored(model: Any, *where: Any) -> list[Any]:
    with session_factory()() as session:
        return list(session.scalars(select(model).where(*where)))


def _redis_keys(job_id: str) -> list[str]:
    client = streams.redis_client()
    return [name for name in (streams.events_key(job_id), streams.final_key(job_id), streams.cancel_key(job_id))
            if client.exists(name)]


def test_a_finished_job_is_deleted_with_its_streams(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    _finish(job_id)
    assert _redis_keys(job_id) == [streams.events_key(job_id), streams.final_key(job_id)]
    response = client.delete(f"/v1/jobs/{job_id}", headers=auth_headers)
    assert response.status_code == 200, response.text
    assert response.json() == {"id": job_id, "object": "job", "deleted": True}
    assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 404
    assert job_id not in [job["id"] for job in client.get("/v1/jobs", headers=auth_headers).json()["data"]]
    assert _stored(Job, Job.id == job_id) == [] and _redis_keys(job_id) == []
    again = client.delete(f"/v1/jobs/{job_id}", headers=auth_headers)
    assert again.status_code == 404 and again.json()["error"]["field"] == "job_id"


def test_a_queued_job_must_be_cancelled_first(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    refused = client.delete(f"/v1/jobs/{job_id}", headers=auth_headers)
    assert refused.status_code == 409 and refused.json()["error"]["field"] == "job_id"
    assert f"POST /v1/jobs/{job_id}/cancel" in refused.json()["error"]["message"]
    assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).json()["status"] == "queued"  # nothing lost
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth_headers).status_code == 200
    assert client.delete(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 200
    assert _stored(Job, Job.id == job_id) == [] and _redis_keys(job_id) == [streams.cancel_key(job_id)]


def test_a_running_job_cancelled_and_deleted_keeps_its_cancel_flag(client: TestClient,
                                                                   auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
    assert client.delete(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 409
    assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).json()["status"] == "running"
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth_headers).status_code == 200
    assert client.delete(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 200
    # the worker still generating learns of the cancel from this flag alone (worker/cancel_watch.py)
    assert streams.redis_client().exists(streams.cancel_key(job_id))


def test_a_second_delete_of_the_same_job_is_not_found(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    _finish(job_id)
    with session_factory()() as session:  # read before the first delete, as a concurrent request would have
        stale = session.get(Job, job_id)
        assert stale is not None
        assert client.delete(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 200
        with pytest.raises(ApiError) as refused:
            jobs.delete_job(session, stale, f"job {job_id}", "job_id", "")
    assert refused.value.status_code == 404 and refused.value.field == "job_id"


def _followed(follow: Callable[[], AsyncIterator[Any]]) -> list[Any]:
    """What a follower yields up to its last event."""

    async def collect() -> list[Any]:
        events = []
        async with aclosing(follow()) as follower:
            async for event in follower:
                events.append(event)
                if isinstance(event, FinalEvent | DeletedEvent):
                    break
        return events

    return asyncio.run(asyncio.wait_for(collect(), timeout=30))


def test_followers_of_a_job_deleted_under_them_end_saying_so(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    _finish(job_id)
    with session_factory()() as session:  # deleted between its final entry and the followers' read of the store
        session.execute(delete(Job).where(Job.id == job_id))
        session.commit()
    for follow in (lambda: follow_job(job_id), lambda: follow_final(job_id)):
        events = _followed(follow)
        assert isinstance(events[-1], DeletedEvent) and events[-1].job_id == job_id


def test_another_keys_job_is_not_found_and_stays(
    client: TestClient, auth_headers: dict[str, str], new_auth_headers: Callable[[str], dict[str, str]]
) -> None:
    job_id = _submit(client, auth_headers)
    _finish(job_id)
    response = client.delete(f"/v1/jobs/{job_id}", headers=new_auth_headers("intruder"))
    assert response.status_code == 404 and response.json()["error"]["field"] == "job_id"
    assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).json()["status"] == "succeeded"


def _queued_messages(settings: Settings, delivery_id: str) -> int:
    """Messages on the webhook queue that name ``delivery_id``."""
    queued = redis.Redis.from_url(settings.redis_url).lrange(f"{settings.redis_key_prefix}celery:pagedserve.webhooks",
                                                             0, -1)
    return sum(delivery_id.encode() in message for message in queued)


def test_webhook_deliveries_and_attempts_go_with_the_job(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    job_id = _submit(client, auth_headers, webhook_url="http://127.0.0.1:9/nobody-listens")
    _finish(job_id)
    (delivery,) = _stored(WebhookDelivery, WebhookDelivery.job_id == job_id)
    webhooks.deliver(delivery.id)  # one failed attempt recorded; the delivery stays pending for its retry
    assert len(_stored(WebhookAttempt, WebhookAttempt.delivery_id == delivery.id)) == 1
    assert client.delete(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 200
    assert _stored(WebhookDelivery, WebhookDelivery.job_id == job_id) == []
    assert _stored(WebhookAttempt, WebhookAttempt.delivery_id == delivery.id) == []
    queued = _queued_messages(service_settings, delivery.id)
    webhooks.deliver(delivery.id)  # its queued retry finds nothing to send, and records and queues nothing
    assert _stored(WebhookAttempt, WebhookAttempt.delivery_id == delivery.id) == []
    assert _queued_messages(service_settings, delivery.id) == queued


def test_a_job_deleted_while_its_webhook_attempt_runs_ends_the_delivery_quietly(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _submit(client, auth_headers, webhook_url="http://127.0.0.1:9/nobody-listens")
    _finish(job_id)
    (delivery,) = _stored(WebhookDelivery, WebhookDelivery.job_id == job_id)
    posted = []

    def delete_while_posting(url: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, str | None]:
        posted.append(url)
        assert client.delete(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 200
        return 500, "HTTP 500"

    monkeypatch.setattr(webhooks, "post", delete_while_posting)
    queued = _queued_messages(service_settings, delivery.id)
    webhooks.deliver(delivery.id)  # its attempt's record and retry would belong to a deleted delivery
    assert posted and _stored(WebhookDelivery, WebhookDelivery.id == delivery.id) == []
    assert _stored(WebhookAttempt, WebhookAttempt.delivery_id == delivery.id) == []
    assert _queued_messages(service_settings, delivery.id) == queued  # no retry queued


def test_a_batchs_job_stays_while_the_batch_does(client: TestClient, auth_headers: dict[str, str]) -> None:
    model = client.get("/v1/models", headers=auth_headers).json()["data"][0]["id"]
    line = b'{"custom_id": "r0", "method": "POST", "url": "/v1/completions", "body": {"model": "%s", "prompt": "x"}}'
    upload = client.post("/v1/files", headers=auth_headers, data={"purpose": "batch"},
                         files={"file": ("in.jsonl", line % model.encode(), "application/jsonl")})
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = client.post("/v1/batches", json=body, headers=auth_headers).json()
    (job_id,) = [str(request.job_id) for request in _stored(BatchRequest, BatchRequest.batch_id == batch["id"])]
    _finish(job_id)
    refused = client.delete(f"/v1/jobs/{job_id}", headers=auth_headers)
    assert refused.status_code == 409 and batch["id"] in refused.json()["error"]["message"]
    assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).json()["status"] == "succeeded"


def test_a_response_is_deleted_as_openai_deletes_one(client: TestClient, auth_headers: dict[str, str]) -> None:
    model = client.get("/v1/models", headers=auth_headers).json()["data"][0]["id"]
    created = client.post("/v1/responses", json={"model": model, "input": "Hi", "background": True},
                          headers=auth_headers)
    response_id = created.json()["id"]
    refused = client.delete(f"/v1/responses/{response_id}", headers=auth_headers)
    assert refused.status_code == 409 and refused.json()["error"]["param"] == "response_id"
    assert f"POST /v1/responses/{response_id}/cancel" in refused.json()["error"]["message"]
    assert client.post(f"/v1/responses/{response_id}/cancel", headers=auth_headers).status_code == 200
    deleted = client.delete(f"/v1/responses/{response_id}", headers=auth_headers)
    assert deleted.status_code == 200 and deleted.json() == {"id": response_id, "object": "response", "deleted": True}
    assert client.get(f"/v1/responses/{response_id}", headers=auth_headers).status_code == 404


def test_a_plain_job_is_no_response_to_delete(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    _finish(job_id)
    assert client.delete(f"/v1/responses/{job_id}", headers=auth_headers).status_code == 404
    assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 200
