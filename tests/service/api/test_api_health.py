"""Liveness, readiness and the OpenAPI document."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings


def test_healthz_is_ok(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}


def test_readyz_checks_database_and_redis(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200 and response.json() == {"status": "ok", "database": "ok", "redis": "ok"}


def test_readyz_is_503_naming_an_unreachable_redis(service_settings: Settings) -> None:
    broken = service_settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    try:
        response = TestClient(create_app(broken)).get("/readyz")
    finally:
        create_app(service_settings)
    assert response.status_code == 503 and response.json()["redis"].startswith("error")
    assert response.json()["database"] == "ok"


def test_openapi_documents_the_job_routes(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/batch", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
            "/v1/jobs/{job_id}/events"} <= set(paths)
