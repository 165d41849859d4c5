"""Per-key rate limits and in-flight caps (429 with Retry-After), constant-time key checks, no secrets in logs."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import find_api_key
from core.db import session_factory
from core.settings import Settings, configure

Headers = Callable[[str], dict[str, str]]


@pytest.fixture
def limited(service_settings: Settings) -> Iterator[TestClient]:
    """A client of an app with tight limits: 5 requests per second and 2 jobs in flight per key."""
    settings = service_settings.model_copy(update={"rate_limit_per_s": 5, "max_inflight_jobs_per_key": 2})
    with TestClient(create_app(settings)) as client:
        yield client
    configure(service_settings)


def test_requests_past_the_rate_limit_get_429_with_retry_after(limited: TestClient, new_auth_headers: Headers) -> None:
    headers = new_auth_headers("rate")
    responses = [limited.get("/v1/jobs", headers=headers) for _ in range(12)]
    refused = [r for r in responses if r.status_code == 429]
    assert refused and {r.status_code for r in responses} <= {200, 429}
    assert refused[0].headers["Retry-After"] == "1"
    assert "at most 5 requests per second" in refused[0].json()["error"]["message"]
    assert limited.get("/v1/jobs", headers=new_auth_headers("other")).status_code == 200


def test_jobs_past_the_in_flight_cap_get_429_per_key(limited: TestClient, new_auth_headers: Headers) -> None:
    headers = new_auth_headers("cap")
    body = {"prompt": "Hi", "max_tokens": 2}
    assert [limited.post("/v1/jobs", json=body, headers=headers).status_code for _ in range(2)] == [202, 202]
    refused = limited.post("/v1/jobs", json=body, headers=headers)
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert "too many jobs in flight: 2 queued or running" in refused.json()["error"]["message"]
    other = new_auth_headers("cap-other")
    assert limited.post("/v1/jobs/batch", json={"jobs": [body] * 3}, headers=other).status_code == 429
    assert limited.post("/v1/jobs/batch", json={"jobs": [body] * 2}, headers=other).status_code == 202


def test_keys_are_compared_in_constant_time(
    client: TestClient, auth_headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    forged = auth_headers["Authorization"][:-4] + "AAAA"
    assert client.get("/v1/jobs", headers={"Authorization": forged}).status_code == 401
    assert client.get("/v1/jobs", headers=auth_headers).status_code == 200
    assert len(calls) == 2


def test_no_key_prompt_or_secret_is_logged_at_the_default_level(
    client: TestClient, auth_headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    prompt = "my secret prompt 4f1c9e"
    caplog.set_level(logging.INFO)
    job = client.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 2}, headers=auth_headers).json()
    client.get(f"/v1/jobs/{job['id']}", headers=auth_headers)
    client.get("/v1/jobs", headers={"Authorization": auth_headers["Authorization"] + "x"})
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth_headers)
    token = auth_headers["Authorization"].removeprefix("Bearer ")
    with session_factory()() as session:
        key = find_api_key(session, token)
        assert key is not None
    assert job["id"] in caplog.text  # the job's lifecycle was logged...
    for secret in (token, token.split("_", 2)[2], prompt, key.webhook_secret):
        assert secret not in caplog.text  # ...but none of what it carried
