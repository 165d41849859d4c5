"""Open event streams hold no database connection: with a pool of one, 50 streams leave room for everyone else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import pytest

from api.app import create_app
from core.settings import Settings, configure
from tests.service.procs import served

Headers = Callable[[str], dict[str, str]]
NUM_STREAMS = 50
# Far below the pool's 30 s checkout timeout: a stream or GET waiting on a connection held by a stream fails.
CLIENT_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """SQLite, where the issue was seen (15 streams made another tenant's GET take 28 s)."""
    return sqlite_url


@pytest.fixture(scope="module")
def one_connection_api(service_settings: Settings) -> Iterator[str]:
    """Base URL of a real uvicorn server whose process has a single database connection."""
    settings = service_settings.model_copy(update={"database_pool_size": 1, "database_max_overflow": 0})
    with served(create_app(settings)) as url:
        yield url
    configure(service_settings)


def _open_streams(stack: ExitStack, client: httpx.Client, requests: list[tuple[str, str, dict]]) -> None:
    for method, path, body in requests:
        response = stack.enter_context(client.stream(method, path, json=body or None))
        assert response.status_code == 200, response.read()


def test_fifty_open_streams_leave_the_single_connection_to_another_tenant(
    one_connection_api: str, new_auth_headers: Headers
) -> None:
    streamer, other = new_auth_headers("streamer"), new_auth_headers("other-tenant")
    limits = httpx.Limits(max_connections=NUM_STREAMS + 10)
    with httpx.Client(base_url=one_connection_api, headers=streamer, timeout=CLIENT_TIMEOUT_S,
                      limits=limits) as client, ExitStack() as stack:
        model = client.get("/v1/models").json()["data"][0]["id"]
        job_id = client.post("/v1/jobs", json={"prompt": "never runs: no worker"}).json()["id"]
        openai_body = {"model": model, "prompt": "Hi", "max_tokens": 2, "stream": True}
        requests = [("GET", f"/v1/jobs/{job_id}/events", {})] * (NUM_STREAMS - 10)
        requests += [("POST", "/v1/completions", openai_body)] * 10
        _open_streams(stack, client, requests)
        with httpx.Client(base_url=one_connection_api, headers=other, timeout=CLIENT_TIMEOUT_S) as tenant:
            own = tenant.post("/v1/jobs", json={"prompt": "mine"})
            fetched = tenant.get(f"/v1/jobs/{own.json()['id']}")
            listed = tenant.get("/v1/jobs")
    assert (own.status_code, fetched.status_code, listed.status_code) == (202, 200, 200)
    assert fetched.json()["status"] == "queued"
