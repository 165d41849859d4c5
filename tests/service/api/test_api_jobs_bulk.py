"""GET /v1/jobs?ids=...: many jobs' states in one request, in the order asked, only the caller's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from api.jobs import MAX_BULK_IDS


def _submit(client: TestClient, headers: dict[str, str], count: int) -> list[str]:
    body = {"jobs": [{"prompt": "the quick fox", "max_tokens": 1}] * count}
    return [job["id"] for job in client.post("/v1/jobs/batch", json=body, headers=headers).json()["data"]]


def test_ids_return_those_jobs_in_the_order_asked(client: TestClient, auth_headers: dict[str, str]) -> None:
    job_ids = _submit(client, auth_headers, 3)
    asked = [job_ids[2], job_ids[0], job_ids[1], job_ids[0]]  # a repeat is answered once
    response = client.get("/v1/jobs", params={"ids": ",".join(asked)}, headers=auth_headers)
    assert response.status_code == 200, response.text
    assert [job["id"] for job in response.json()["data"]] == [job_ids[2], job_ids[0], job_ids[1]]
    assert response.json()["next_cursor"] is None


def test_another_keys_job_is_404_naming_it(
    client: TestClient, auth_headers: dict[str, str], new_auth_headers: Callable[[str], dict[str, str]]
) -> None:
    (mine,), (theirs,) = _submit(client, auth_headers, 1), _submit(client, new_auth_headers("other"), 1)
    response = client.get("/v1/jobs", params={"ids": f"{mine},{theirs}"}, headers=auth_headers)
    error = response.json()["error"]
    assert response.status_code == 404 and error["field"] == "ids"
    assert theirs in error["message"] and mine not in error["message"]


@pytest.mark.parametrize(("params", "message"), [
    ({"ids": "job_a,,job_b"}, "without empty entries"),
    ({"ids": ",".join(f"job_{i}" for i in range(MAX_BULK_IDS + 1))}, f"at most {MAX_BULK_IDS} jobs, got 501"),
    ({"ids": "job_a", "status": "queued"}, "cannot be combined"),
])
def test_bad_ids_are_422_naming_the_field(
    client: TestClient, auth_headers: dict[str, str], params: dict[str, str], message: str
) -> None:
    response = client.get("/v1/jobs", params=params, headers=auth_headers)
    error = response.json()["error"]
    assert response.status_code == 422 and message in error["message"] and error["field"] == "ids"
