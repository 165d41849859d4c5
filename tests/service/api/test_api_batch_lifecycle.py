"""OpenAI batch states without reading the batch: finalized when its last job ends, expired past its window."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from core import batch_progress, queue, streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import Batch, BatchRequest, BatchStatus, JobStatus, utcnow
from worker.reaper import Reaper

OUTPUT = [{"index": 0, "text": " fox", "token_ids": [7], "finish_reason": "length", "logprobs": None}]


def _create(client: TestClient, headers: dict[str, str], num_lines: int,
            bodies: dict[int, dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """A batch of num_lines completions (line i's body updated by ``bodies[i]``) and its job ids in line order."""
    model = client.get("/v1/models", headers=headers).json()["data"][0]["id"]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "the quick", "max_tokens": 1, **(bodies or {}).get(i, {})}}
             for i in range(num_lines)]
    content = "\n".join(json.dumps(line) for line in lines).encode()
    upload = client.post("/v1/files", headers=headers, data={"purpose": "batch"},
                         files={"file": ("in.jsonl", content, "application/jsonl")})
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = client.post("/v1/batches", json=body, headers=headers).json()
    with session_factory()() as session:
        job_ids = session.scalars(select(BatchRequest.job_id).where(BatchRequest.batch_id == batch["id"])
                                  .order_by(BatchRequest.line_number)).all()
    return batch, [str(job_id) for job_id in job_ids]


def _run(job_id: str, to: JobStatus | None = JobStatus.succeeded) -> None:
    """Record a job's run as a worker does: claimed, then (unless `to` is None) finished."""
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued}, worker_id="test:1", attempts=1,
                   started_at=utcnow())
        if to is not None:
            transition(session, job_id, to, {JobStatus.running}, output=OUTPUT, prompt_tokens=2, completion_tokens=1)


def _stored(batch_id: str) -> Batch:
    """The batch row as stored, read without refreshing it."""
    with session_factory()() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        return batch


def _lines(client: TestClient, headers: dict[str, str], file_id: str) -> list[dict[str, Any]]:
    text = client.get(f"/v1/files/{file_id}/content", headers=headers).text
    return [json.loads(line) for line in text.splitlines()]


def test_a_batch_is_in_progress_with_its_window_and_its_jobs_below_interactive_ones(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    batch, job_ids = _create(client, auth_headers, 2)
    assert batch["status"] == "in_progress" and batch["expires_at"] == batch["created_at"] + 24 * 3600
    job = client.get(f"/v1/jobs/{job_ids[0]}", headers=auth_headers).json()
    assert job["priority"] == 500 and queue.broker_level(job["priority"]) > queue.broker_level(0)


def test_a_batch_completes_when_its_last_job_ends_without_being_read(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    batch, job_ids = _create(client, auth_headers, 3)
    for job_id in job_ids[:2]:
        _run(job_id)
        with session_factory()() as session:
            batch_progress.refresh_batch_of_job(session, job_id)  # what a worker does when a job ends
    assert _stored(batch["id"]).status is BatchStatus.in_progress
    _run(job_ids[2])
    with session_factory()() as session:
        batch_progress.refresh_batch_of_job(session, job_ids[2])
    stored = _stored(batch["id"])
    assert stored.status is BatchStatus.completed and stored.output_file_id and stored.error_file_id is None
    assert stored.finalizing_at is not None and stored.completed_at is not None
    assert stored.finalizing_at <= stored.completed_at
    lines = _lines(client, auth_headers, stored.output_file_id)
    assert [line["custom_id"] for line in lines] == ["r0", "r1", "r2"]


def test_a_lines_error_has_the_status_and_code_the_endpoint_would_have_answered(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    batch, job_ids = _create(client, auth_headers, 3, {1: {"model": "no-such-model"}, 2: {"temperature": -3}})
    (job_id,) = [job_id for job_id in job_ids if job_id != "None"]
    _run(job_id)
    with session_factory()() as session:
        batch_progress.refresh_batch_of_job(session, job_id)
    stored = _stored(batch["id"])
    assert stored.status is BatchStatus.completed and stored.error_file_id
    unknown, invalid = _lines(client, auth_headers, stored.error_file_id)
    assert unknown["response"]["status_code"] == 404
    assert unknown["response"]["body"]["error"] | {"message": ""} == {
        "message": "", "type": "not_found_error", "param": "model", "code": "model_not_found"}
    assert invalid["response"]["status_code"] == 400
    assert invalid["response"]["body"]["error"]["param"] == "temperature"


def test_a_batch_past_its_window_expires_with_partial_output_and_its_unfinished_jobs_cancelled(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    batch, (done, running, queued) = _create(client, auth_headers, 3)
    _run(done)
    _run(running, to=None)
    with session_factory()() as session:
        session.execute(update(Batch).where(Batch.id == batch["id"]).values(expires_at=utcnow() - timedelta(seconds=1)))
        session.commit()
    assert batch["id"] in Reaper().run_once()["batches"]
    expired = client.get(f"/v1/batches/{batch['id']}", headers=auth_headers).json()
    assert expired["status"] == "expired" and expired["expired_at"] is not None
    assert expired["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert [line["custom_id"] for line in _lines(client, auth_headers, expired["output_file_id"])] == ["r0"]
    errors = _lines(client, auth_headers, expired["error_file_id"])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("r1", "batch_expired"), ("r2", "batch_expired")]
    for job_id in (running, queued):
        assert client.get(f"/v1/jobs/{job_id}", headers=auth_headers).json()["status"] == "cancelled"
    assert streams.redis_client().exists(streams.cancel_key(running))  # its worker aborts it


def test_a_batch_left_finalizing_by_a_dead_caller_is_completed_by_the_reaper(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    batch, job_ids = _create(client, auth_headers, 1)
    _run(job_ids[0])
    with session_factory()() as session:
        session.execute(update(Batch).where(Batch.id == batch["id"]).values(
            status=BatchStatus.finalizing, finalizing_at=utcnow() - timedelta(hours=1)))
        session.commit()
    assert batch["id"] in Reaper().run_once()["batches"]
    assert _stored(batch["id"]).status is BatchStatus.completed


def test_cancelling_a_batch_whose_jobs_all_ended_is_refused_naming_its_state(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    batch, job_ids = _create(client, auth_headers, 1)
    _run(job_ids[0], to=JobStatus.failed)
    refused = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth_headers)
    assert refused.status_code == 409 and "already completed" in refused.json()["error"]["message"]


def test_a_line_may_run_later_than_the_batch_priority_but_never_sooner(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    batch, job_ids = _create(client, auth_headers, 3, {1: {"priority": 700}, 2: {"priority": 0}})
    ran = [job_id for job_id in job_ids if job_id != "None"]
    priorities = [client.get(f"/v1/jobs/{job_id}", headers=auth_headers).json()["priority"] for job_id in ran]
    assert priorities == [500, 700]  # without a priority of its own a line runs at the batch priority
    for job_id in ran:
        _run(job_id)
        with session_factory()() as session:
            batch_progress.refresh_batch_of_job(session, job_id)
    (refused,) = _lines(client, auth_headers, _stored(batch["id"]).error_file_id or "")
    assert refused["custom_id"] == "r2" and refused["response"]["status_code"] == 403
    error = refused["response"]["body"]["error"]
    assert error["param"] == "priority" and "batch priority 500" in error["message"]
