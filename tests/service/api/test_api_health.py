"""Liveness, readiness and the OpenAPI document."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from core.settings import Settings


def test_healthz_is_ok(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}


def test_readyz_checks_model_database_and_redis(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "model": "ok", "database": "ok", "redis": "ok"}


def test_readyz_is_503_naming_an_unreachable_redis(service_settings: Settings) -> None:
    broken = service_settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    try:
        response = TestClient(create_app(broken)).get("/readyz")
    finally:
        create_app(service_settings)
    assert response.status_code == 503 and response.json()["redis"] == "error: unavailable"
    assert "127.0.0.1" not in response.text  # the exception's text (hosts, users) is logged, not shown
    assert response.json()["database"] == "ok"


def test_openapi_documents_the_job_routes(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/batch", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel",
            "/v1/jobs/{job_id}/events"} <= set(paths)
    assert {"get", "delete"} <= set(paths["/v1/jobs/{job_id}"])
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    deleted = paths["/v1/responses/{response_id}"]["delete"]["responses"]["200"]["content"]["application/json"]
    assert deleted["schema"]["$ref"].endswith("/ResponseDeleted")


def test_the_api_process_never_imports_torch(api_model_dir: Path) -> None:
    code = (
        "import sys; from api.app import create_app; from cli.main import main; "
        f"from core.prompts import load_prompt_model; create_app(); load_prompt_model({str(api_model_dir)!r}); "
        "heavy = [m for m in ('torch', 'transformers', 'engine.llm_engine') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
