"""An in-process API client over the module's real store and Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.settings import Settings


@pytest.fixture(scope="module")
def client(service_settings: Settings) -> Iterator[TestClient]:
    """A TestClient of the app built with this module's settings."""
    with TestClient(create_app(service_settings)) as test_client:
        yield test_client
