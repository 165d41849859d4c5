"""Property-based fuzzing of the OpenAPI spec with schemathesis: no 5xx and responses that match their schemas."""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

# The synchronous OpenAI calls wait for a worker, which this in-process API has not got.
NEEDS_A_WORKER = r"^/v1/((chat/)?completions|responses)$"
MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """Fuzzing exercises the API, not the store: SQLite only, to keep it quick."""
    return sqlite_url


def _fuzz(operation: schemathesis.APIOperation, headers: dict[str, str]) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=headers, checks=[not_a_server_error, response_schema_conformance])

    check()


def test_no_input_makes_the_api_fail_or_break_its_schema(client: TestClient, auth_headers: dict[str, str]) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", client.app).exclude(path_regex=NEEDS_A_WORKER)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 15
    for operation in operations:
        _fuzz(operation, auth_headers)
