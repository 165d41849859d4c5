"""The API's /metrics: jobs by status, queue depth and request latency by route template."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.db import session_factory
from core.models import Job, JobStatus
from tests.observability.promtext import value, value_or_zero


def _scrape(client: TestClient) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return response.text


def _submit(client: TestClient, auth_headers: dict[str, str]) -> str:
    response = client.post("/v1/jobs", json={"prompt": "the quick fox", "max_tokens": 4}, headers=auth_headers)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def test_submitted_jobs_are_counted_and_shown_queued(client: TestClient, auth_headers: dict[str, str]) -> None:
    before = _scrape(client)
    for _ in range(3):
        _submit(client, auth_headers)
    after = _scrape(client)
    assert value(after, "pagedserve_jobs_submitted_total") - value(before, "pagedserve_jobs_submitted_total") == 3
    queued = value(after, "pagedserve_jobs", status="queued") - value(before, "pagedserve_jobs", status="queued")
    assert queued == 3
    with session_factory()() as session:  # counted here, apart from the exporter's query
        queued_in_store = session.scalar(select(func.count()).select_from(Job).where(Job.status == JobStatus.queued))
    assert value(after, "pagedserve_queue_depth") == queued_in_store


def test_cancelled_job_is_counted_as_finished_by_status(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    before = _scrape(client)
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth_headers).status_code == 200
    after = _scrape(client)
    for name in ("pagedserve_jobs_finished_total", "pagedserve_jobs"):
        assert value(after, name, status="cancelled") - value_or_zero(before, name, status="cancelled") == 1, name
    assert value_or_zero(after, "pagedserve_jobs_finished_total", status="succeeded") == value_or_zero(
        before, "pagedserve_jobs_finished_total", status="succeeded")


def test_request_latency_is_labelled_by_route_template(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_id = _submit(client, auth_headers)
    labels = {"method": "GET", "route": "/v1/jobs/{job_id}", "status_code": "200"}
    before = value_or_zero(_scrape(client), "pagedserve_http_request_duration_seconds_count", **labels)
    assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).status_code == 200
    assert client.get("/no/such/path").status_code == 404
    after = _scrape(client)
    assert value(after, "pagedserve_http_request_duration_seconds_count", **labels) == before + 1
    unmatched = {"method": "GET", "route": "unmatched", "status_code": "404"}
    assert value(after, "pagedserve_http_request_duration_seconds_count", **unmatched) >= 1
    assert f"/v1/jobs/{job_id}" not in after
