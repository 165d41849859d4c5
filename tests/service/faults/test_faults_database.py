"""PostgreSQL going down under a running API: 503 with a clear message, then recovery without a restart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.settings import Settings
from tests.service.faults.servers import PrivatePostgres, postgres_bin_dir

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL cluster of this module's own, which its test stops and starts."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries under /usr/lib/postgresql")
    server = PrivatePostgres(bin_dir).init()
    server.start()
    yield server
    server.remove()


@pytest.fixture(scope="module")
def database_url(private_postgres: PrivatePostgres) -> str:
    """The module's store is on the private server."""
    return private_postgres.url


def test_api_answers_503_while_postgres_is_down_and_recovers(
    service_settings: Settings, auth_headers: dict[str, str], private_postgres: PrivatePostgres
) -> None:
    client = TestClient(create_app(service_settings))
    accepted = client.post("/v1/jobs", json={"prompt": "Keep me", "max_tokens": 2}, headers=auth_headers)
    assert accepted.status_code == 202
    private_postgres.stop()
    try:
        down = [client.get("/v1/jobs", headers=auth_headers),
                client.post("/v1/jobs", json={"prompt": "Now?", "max_tokens": 2}, headers=auth_headers)]
        openai = client.post("/v1/completions", json={"prompt": "Now?", "max_tokens": 2}, headers=auth_headers)
        ready = client.get("/readyz")
    finally:
        private_postgres.start()
    assert [r.status_code for r in down] == [503, 503]
    assert all(r.headers["Retry-After"] == "5" for r in down)
    assert "job store (database) is unavailable" in down[0].json()["error"]["message"]
    assert openai.status_code == 503 and openai.headers["Retry-After"] == "5"  # in OpenAI's error shape
    assert "job store (database) is unavailable" in openai.json()["error"]["message"]
    assert openai.json()["error"]["type"] and "detail" not in openai.json()
    assert ready.status_code == 503 and ready.json()["database"].startswith("error")
    job = client.get(f"/v1/jobs/{accepted.json()['id']}", headers=auth_headers)
    assert job.status_code == 200 and job.json()["status"] == "queued"
    assert client.get("/readyz").status_code == 200
