"""Submitting, reading, listing and cancelling jobs through the REST API."""

from __future__ import annotations

from collections.abc import Callable

import redis
from fastapi.testclient import TestClient

from core import queue
from core.settings import Settings


def _default_level_key() -> str:
    """The broker list of priority-0 jobs."""
    return queue.broker_queue_keys(queue.JOBS_QUEUE)[queue.MIDDLE_LEVEL]


def _queue_length(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.redis_url)
    return int(client.llen(_default_level_key()))


def test_submit_returns_202_and_the_queued_job(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/v1/jobs", json={"prompt": "the quick fox", "max_tokens": 8}, headers=auth_headers)
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued" and job["id"].startswith("job_")
    assert job["params"]["max_tokens"] == 8 and job["prompt_tokens"] > 0
    fetched = client.get(f"/v1/jobs/{job['id']}", headers=auth_headers).json()
    assert fetched["id"] == job["id"] and fetched["status"] == "queued"


def test_submit_puts_only_the_job_id_on_the_queue(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    before = _queue_length(service_settings)
    job = client.post("/v1/jobs", json={"prompt": "the lazy dog"}, headers=auth_headers).json()
    assert _queue_length(service_settings) == before + 1
    raw = redis.Redis.from_url(service_settings.redis_url).lindex(_default_level_key(), 0)
    assert job["id"].encode() in raw and b"lazy dog" not in raw


def test_messages_are_rendered_with_the_chat_template(client: TestClient, auth_headers: dict[str, str]) -> None:
    body = {"messages": [{"role": "user", "content": "hi fox"}], "max_tokens": 4}
    job = client.post("/v1/jobs", json=body, headers=auth_headers).json()
    assert job["prompt"] == "<|im_start|>user\nhi fox<|im_end|>\n<|im_start|>assistant\n"
    assert job["messages"] == body["messages"]


def test_requests_without_a_valid_key_are_refused(client: TestClient) -> None:
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer psk_nope_nope"}).status_code == 401
    assert client.post("/v1/jobs", json={"prompt": "x"}, headers={"Authorization": "Basic abc"}).status_code == 401


def test_a_key_sees_only_its_own_jobs(
    client: TestClient, auth_headers: dict[str, str], new_auth_headers: Callable[[str], dict[str, str]]
) -> None:
    mine = client.post("/v1/jobs", json={"prompt": "mine"}, headers=auth_headers).json()
    other = new_auth_headers("other")
    assert client.get(f"/v1/jobs/{mine['id']}", headers=other).status_code == 404
    assert client.post(f"/v1/jobs/{mine['id']}/cancel", headers=other).status_code == 404
    assert client.get(f"/v1/jobs/{mine['id']}/events", headers=other).status_code == 404
    assert client.get(f"/v1/jobs/{mine['id']}/webhooks", headers=other).status_code == 404
    assert client.get("/v1/jobs", headers=other).json()["data"] == []


def test_same_idempotency_key_and_body_return_the_same_job(client: TestClient, auth_headers: dict[str, str]) -> None:
    headers = {**auth_headers, "Idempotency-Key": "order-17"}
    first = client.post("/v1/jobs", json={"prompt": "once"}, headers=headers)
    second = client.post("/v1/jobs", json={"prompt": "once"}, headers=headers)
    assert first.status_code == 202 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]


def test_same_idempotency_key_with_another_body_is_a_conflict(client: TestClient, auth_headers: dict[str, str]) -> None:
    headers = {**auth_headers, "Idempotency-Key": "order-18"}
    assert client.post("/v1/jobs", json={"prompt": "one"}, headers=headers).status_code == 202
    response = client.post("/v1/jobs", json={"prompt": "two"}, headers=headers)
    assert response.status_code == 409 and response.json()["error"]["field"] == "Idempotency-Key"


def test_cancelling_a_queued_job_makes_it_final(client: TestClient, auth_headers: dict[str, str]) -> None:
    job = client.post("/v1/jobs", json={"prompt": "stop me"}, headers=auth_headers).json()
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth_headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    again = client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth_headers)
    assert again.status_code == 409 and "already cancelled" in again.json()["error"]["message"]


def test_list_filters_by_status_and_pages_with_a_cursor(
    client: TestClient, new_auth_headers: Callable[[str], dict[str, str]]
) -> None:
    headers = new_auth_headers("lister")
    ids = [client.post("/v1/jobs", json={"prompt": f"p{i}"}, headers=headers).json()["id"] for i in range(5)]
    client.post(f"/v1/jobs/{ids[0]}/cancel", headers=headers)
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/jobs", params=params, headers=headers).json()
        seen += [job["id"] for job in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids[::-1]
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}, headers=headers).json()["data"]
    assert [job["id"] for job in cancelled] == [ids[0]]


def test_batch_creates_all_jobs_in_order(client: TestClient, auth_headers: dict[str, str]) -> None:
    body = {"jobs": [{"prompt": f"batch {i}", "max_tokens": 2} for i in range(3)]}
    response = client.post("/v1/jobs/batch", json=body, headers=auth_headers)
    assert response.status_code == 202
    assert [job["prompt"] for job in response.json()["data"]] == ["batch 0", "batch 1", "batch 2"]


def test_batch_with_one_bad_job_creates_none(
    client: TestClient, new_auth_headers: Callable[[str], dict[str, str]]
) -> None:
    headers = new_auth_headers("batcher")
    body = {"jobs": [{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": "fox " * 200}]}
    response = client.post("/v1/jobs/batch", json=body, headers=headers)
    assert response.status_code == 422 and response.json()["error"]["field"] == "jobs.2.prompt"
    assert client.get("/v1/jobs", headers=headers).json()["data"] == []
