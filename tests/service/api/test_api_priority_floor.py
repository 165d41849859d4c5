"""Per-key priority floors: an urgent priority preempts other tenants' running jobs, so a key asks for one only
as far as the operator lets it (`--priority-floor`, `pagedserve keys update`); what it sends beyond is a 403
naming `priority`, and a job without a priority runs at the key's floor when that is above 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from core import queue
from core.db import session_factory
from core.models import Job
from core.settings import Settings, configure

NewHeaders = Callable[..., dict[str, str]]
BODY = {"prompt": "Hi", "max_tokens": 1}


def _job_count() -> int:
    with session_factory()() as session:
        return session.scalar(select(func.count()).select_from(Job)) or 0


def _priority(job_id: str) -> int:
    with session_factory()() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.priority


def _completion(client: TestClient, headers: dict[str, str], **fields: Any) -> Any:
    model = client.get("/v1/models", headers=headers).json()["data"][0]["id"]
    return client.post("/v1/completions", headers=headers,
                       json={"model": model, "prompt": "Hi", "max_tokens": 1, **fields})


def test_a_key_without_a_floor_of_its_own_may_not_ask_for_an_urgent_priority(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    before = _job_count()
    for priority in (-1, -1000):
        response = client.post("/v1/jobs", json={**BODY, "priority": priority}, headers=auth_headers)
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["field"] == "priority" and "priority floor is 0" in error["message"]
    batch = client.post("/v1/jobs/batch", json={"jobs": [BODY, {**BODY, "priority": -3}]}, headers=auth_headers)
    assert batch.status_code == 403 and batch.json()["error"]["field"] == "jobs.1.priority"
    assert _job_count() == before  # nothing of a refused request is kept
    accepted = client.post("/v1/jobs", json={**BODY, "priority": 7}, headers=auth_headers)
    assert accepted.status_code == 202 and accepted.json()["priority"] == 7


def test_a_trusted_key_may_ask_down_to_its_floor_and_reaches_the_most_urgent_broker_list(
    client: TestClient, new_auth_headers: NewHeaders
) -> None:
    trusted = new_auth_headers("trusted", -500)
    urgent = client.post("/v1/jobs", json={**BODY, "priority": -500}, headers=trusted)
    assert urgent.status_code == 202 and _priority(urgent.json()["id"]) == -500
    assert queue.broker_level(-500) < queue.broker_level(0)
    beyond = client.post("/v1/jobs", json={**BODY, "priority": -501}, headers=trusted)
    assert beyond.status_code == 403 and "priority floor is -500" in beyond.json()["error"]["message"]
    plain = client.post("/v1/jobs", json=BODY, headers=trusted)  # a trusted key's default stays 0
    assert plain.status_code == 202 and plain.json()["priority"] == 0


def test_a_demoted_keys_jobs_run_at_its_floor(client: TestClient, new_auth_headers: NewHeaders) -> None:
    demoted = new_auth_headers("noisy", 200)
    plain = client.post("/v1/jobs", json=BODY, headers=demoted)
    assert plain.status_code == 202 and plain.json()["priority"] == 200
    assert client.post("/v1/jobs", json={**BODY, "priority": 0}, headers=demoted).status_code == 403
    assert client.post("/v1/jobs", json={**BODY, "priority": 300}, headers=demoted).json()["priority"] == 300


def test_openai_routes_take_vllms_priority_within_the_floor(client: TestClient, new_auth_headers: NewHeaders) -> None:
    demoted = new_auth_headers("openai-noisy", 200)
    before = _job_count()
    refused = _completion(client, demoted, priority=100)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"] | {"message": ""} == {
        "message": "", "type": "permission_error", "param": "priority", "code": None}
    out_of_range = _completion(client, demoted, priority=5000)
    assert out_of_range.status_code == 400 and out_of_range.json()["error"]["param"] == "priority"
    assert _job_count() == before


@pytest.fixture
def floorless_client(service_settings: Settings) -> Iterator[TestClient]:
    """A client of an app whose server-wide floor lets every key ask for any priority (one tenant's service)."""
    with TestClient(create_app(service_settings.model_copy(update={"priority_floor": -1000}))) as client:
        yield client
    configure(service_settings)  # the module's settings again for the tests after


def test_the_server_floor_applies_to_keys_without_their_own(
    floorless_client: TestClient, auth_headers: dict[str, str], new_auth_headers: NewHeaders
) -> None:
    urgent = floorless_client.post("/v1/jobs", json={**BODY, "priority": -1000}, headers=auth_headers)
    assert urgent.status_code == 202 and urgent.json()["priority"] == -1000
    limited = new_auth_headers("limited", 0)  # its own floor wins over the server's
    assert floorless_client.post("/v1/jobs", json={**BODY, "priority": -1}, headers=limited).status_code == 403
