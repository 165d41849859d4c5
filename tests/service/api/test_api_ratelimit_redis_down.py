"""The per-key rate limit fails open while Redis is down: requests are served and a warning is logged."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.settings import Settings, configure
from tests.service.procs import free_port


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """The limiter does not touch the store: SQLite only."""
    return sqlite_url


@pytest.fixture
def redis_down(service_settings: Settings) -> Iterator[Settings]:
    """The module's settings with a limit of one request a second and Redis on a port nothing listens on."""
    settings = service_settings.model_copy(
        update={"rate_limit_per_s": 1, "redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    configure(settings)
    yield settings
    configure(service_settings)


def test_requests_are_served_and_a_warning_logged_while_redis_is_down(
    auth_headers: dict[str, str], redis_down: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    client = TestClient(create_app(redis_down))
    with caplog.at_level(logging.WARNING, logger="pagedserve.api"):
        statuses = [client.get("/v1/jobs", headers=auth_headers).status_code for _ in range(3)]
    assert statuses == [200, 200, 200]  # nothing can count them, so none is refused
    assert sum("ratelimit.unavailable" in record.getMessage() for record in caplog.records) == 3
