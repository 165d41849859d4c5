"""The OpenAI Batch API through the official `openai` openai_client, against live API and worker processes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types import Batch

from core.db import session_factory
from core.models import Batch as StoredBatch
from core.models import BatchStatus
from tests.service.procs import wait_until


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """PostgreSQL only: the inference module runs on SQLite, so each store is covered with one service start-up."""
    return postgresql_url


def _create_batch(openai_client: openai.OpenAI, lines: list[dict], **extra: object) -> Batch:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    input_file = openai_client.files.create(file=("batch.jsonl", content), purpose="batch")
    return openai_client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", **extra)


def _chat_line(model: str, i: int, max_tokens: int, **extra: object) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Question number {i}"}], **extra}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _wait_batch(openai_client: openai.OpenAI, batch_id: str, statuses: set[str]) -> Batch:
    batch = openai_client.batches.retrieve(batch_id)

    def reached() -> bool:
        nonlocal batch
        batch = openai_client.batches.retrieve(batch_id)
        return batch.status in statuses

    wait_until(reached, 90, f"batch {batch_id} to reach {statuses}")
    return batch


def test_a_batch_of_120_lines_completes_with_one_result_per_custom_id(openai_client: openai.OpenAI) -> None:
    model = openai_client.models.list().data[0].id
    lines = [_chat_line(model, i, max_tokens=2) for i in range(120)]
    batch = _create_batch(openai_client, lines, metadata={"run": "e2e"})
    assert batch.status == "in_progress" and batch.request_counts.total == 120
    batch = _wait_batch(openai_client, batch.id, {"completed", "failed", "cancelled"})
    assert batch.status == "completed" and batch.error_file_id is None and batch.output_file_id
    assert (batch.request_counts.completed, batch.request_counts.failed) == (120, 0)
    results = [json.loads(line) for line in openai_client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
    for result in results:
        body = result["response"]["body"]
        assert result["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] <= 2 and body["choices"][0]["message"]["role"] == "assistant"
    assert openai_client.batches.list().data[0].id == batch.id


def _stored_status(batch_id: str) -> BatchStatus:
    """The batch's state in the store, read without the API (whose reads also move a batch on)."""
    with session_factory()() as session:
        batch = session.get(StoredBatch, batch_id)
        assert batch is not None
        return batch.status


def test_a_batch_completes_in_the_background_without_being_read(openai_client: openai.OpenAI) -> None:
    model = openai_client.models.list().data[0].id
    batch = _create_batch(openai_client, [_chat_line(model, i, max_tokens=2) for i in range(5)])
    wait_until(lambda: _stored_status(batch.id) is BatchStatus.completed, 90, f"batch {batch.id} to complete")


def test_lines_whose_body_is_invalid_go_to_the_error_file(openai_client: openai.OpenAI) -> None:
    model = openai_client.models.list().data[0].id
    lines = [_chat_line(model, 0, max_tokens=2), _chat_line(model, 1, max_tokens=2, temperature=-3)]
    batch = _create_batch(openai_client, lines)
    batch = _wait_batch(openai_client, batch.id, {"completed"})
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    assert batch.output_file_id and batch.error_file_id
    (error,) = [json.loads(line) for line in openai_client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "req-1" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "temperature"


def test_cancelling_a_batch_stops_its_unstarted_jobs(
    openai_client: openai.OpenAI, live_api: str, auth_headers: dict[str, str]
) -> None:
    model = openai_client.models.list().data[0].id
    lines = [_chat_line(model, i, max_tokens=40, ignore_eos=True) for i in range(100)]
    batch = _create_batch(openai_client, lines)
    cancelling = openai_client.batches.cancel(batch.id)
    assert cancelling.status in {"cancelling", "cancelled"}
    batch = _wait_batch(openai_client, batch.id, {"cancelled"})
    assert batch.request_counts.total == 100 and batch.request_counts.failed > 0
    assert batch.request_counts.completed + batch.request_counts.failed == 100
    jobs = httpx.get(f"{live_api}/v1/jobs", params={"limit": 100}, headers=auth_headers).json()["data"]
    cancelled = [j for j in jobs if j["metadata"].get("batch_id") == batch.id and j["status"] == "cancelled"]
    assert len(cancelled) == batch.request_counts.failed and all(j["started_at"] is None for j in cancelled)
    errors = [json.loads(line) for line in openai_client.files.content(batch.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(errors) == len(cancelled)


def test_a_malformed_upload_names_its_line(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.files.create(file=("bad.jsonl", b'{"custom_id": "a"}\n{not json\n'), purpose="batch")
    assert "line 2" in raised.value.message and raised.value.param == "file"


def test_a_batch_with_malformed_lines_fails_naming_each_line(openai_client: openai.OpenAI) -> None:
    model = openai_client.models.list().data[0].id
    lines = [_chat_line(model, 0, 2), {**_chat_line(model, 1, 2), "url": "/v1/embeddings"}, _chat_line(model, 0, 2)]
    batch = _create_batch(openai_client, lines)
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.line, e.message.split(":")[0]) for e in batch.errors.data] == [(2, "line 2"), (3, "line 3")]
