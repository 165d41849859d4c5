"""The OpenAI Batch API through the official `openai` client, against live API and worker processes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types import Batch
from tests.service.procs import wait_until


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """PostgreSQL only: the inference module runs on SQLite, so each store is covered with one service start-up."""
    return postgresql_url


@pytest.fixture(scope="module")
def client(live_api: str, auth_headers: dict[str, str]) -> Iterator[openai.OpenAI]:
    """The official OpenAI client pointed at the live service."""
    token = auth_headers["Authorization"].removeprefix("Bearer ")
    with openai.OpenAI(base_url=f"{live_api}/v1", api_key=token, max_retries=0, timeout=60) as openai_client:
        yield openai_client


def _batch_file(client: openai.OpenAI, lines: list[dict]) -> str:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("batch.jsonl", content), purpose="batch").id


def _chat_line(model: str, i: int, max_tokens: int, **extra: object) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Question number {i}"}], **extra}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _wait_batch(client: openai.OpenAI, batch_id: str, statuses: set[str]) -> Batch:
    batch = client.batches.retrieve(batch_id)

    def reached() -> bool:
        nonlocal batch
        batch = client.batches.retrieve(batch_id)
        return batch.status in statuses

    wait_until(reached, 90, f"batch {batch_id} to reach {statuses}")
    return batch


def test_a_batch_of_120_lines_completes_with_one_result_per_custom_id(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    lines = [_chat_line(model, i, max_tokens=2) for i in range(120)]
    batch = client.batches.create(input_file_id=_batch_file(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "e2e"})
    assert batch.status == "in_progress" and batch.request_counts.total == 120
    batch = _wait_batch(client, batch.id, {"completed", "failed", "cancelled"})
    assert batch.status == "completed" and batch.error_file_id is None and batch.output_file_id
    assert (batch.request_counts.completed, batch.request_counts.failed) == (120, 0)
    results = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
    for result in results:
        body = result["response"]["body"]
        assert result["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] <= 2 and body["choices"][0]["message"]["role"] == "assistant"
    assert client.batches.list().data[0].id == batch.id


def test_lines_whose_body_is_invalid_go_to_the_error_file(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    lines = [_chat_line(model, 0, max_tokens=2), _chat_line(model, 1, max_tokens=2, temperature=-3)]
    batch = client.batches.create(input_file_id=_batch_file(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = _wait_batch(client, batch.id, {"completed"})
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    assert batch.output_file_id and batch.error_file_id
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "req-1" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "temperature"


def test_cancelling_a_batch_stops_its_unstarted_jobs(
    client: openai.OpenAI, live_api: str, auth_headers: dict[str, str]
) -> None:
    model = client.models.list().data[0].id
    lines = [_chat_line(model, i, max_tokens=200, ignore_eos=True) for i in range(100)]
    batch = client.batches.create(input_file_id=_batch_file(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in {"cancelling", "cancelled"}
    batch = _wait_batch(client, batch.id, {"cancelled"})
    assert batch.request_counts.total == 100 and batch.request_counts.failed > 0
    assert batch.request_counts.completed + batch.request_counts.failed == 100
    jobs = httpx.get(f"{live_api}/v1/jobs", params={"limit": 100}, headers=auth_headers).json()["data"]
    cancelled = [j for j in jobs if j["metadata"].get("batch_id") == batch.id and j["status"] == "cancelled"]
    assert len(cancelled) == batch.request_counts.failed and all(j["started_at"] is None for j in cancelled)
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == len(cancelled)


def test_a_malformed_upload_names_its_line(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.files.create(file=("bad.jsonl", b'{"custom_id": "a"}\n{not json\n'), purpose="batch")
    assert "line 2" in raised.value.message and raised.value.param == "file"


def test_a_batch_with_malformed_lines_fails_naming_each_line(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    lines = [_chat_line(model, 0, 2), {**_chat_line(model, 1, 2), "url": "/v1/embeddings"}, _chat_line(model, 0, 2)]
    batch = client.batches.create(input_file_id=_batch_file(client, lines), endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.line, e.message.split(":")[0]) for e in batch.errors.data] == [(2, "line 2"), (3, "line 3")]
