"""A finished batch's output and error files: one JSONL line per input line, matched by custom_id."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.models import Batch, BatchRequest, Job, JobStatus
from core.openai_responses import answer_model, error_object, error_status, job_failure, response_body


def _result(
    request: BatchRequest, job: Job | None, endpoint: str, cancelled: dict[str, str]
) -> tuple[bool, dict[str, Any]]:
    """(succeeded, output line) of one request line."""
    line: dict[str, Any] = {"id": f"batch_req_{request.id}", "custom_id": request.custom_id}
    if request.error is not None:
        response = {"status_code": error_status(request.error), "request_id": None, "body": {"error": request.error}}
        return False, {**line, "response": response, "error": None}
    assert job is not None
    problem = job_failure(job)
    if problem is None:
        response = {"status_code": 200, "request_id": job.id, "body": response_body(job, answer_model(job), endpoint)}
        return True, {**line, "response": response, "error": None}
    if job.status is JobStatus.cancelled:
        return False, {**line, "response": None, "error": cancelled}
    body = {"error": error_object(problem.status_code, problem.message, problem.field)}
    return False, {**line, "response": {"status_code": problem.status_code, "request_id": job.id, "body": body},
                   "error": None}


def output_files(session: Session, batch: Batch, cancelled: dict[str, str]) -> tuple[bytes, bytes]:
    """(output JSONL, error JSONL) of a batch whose jobs are all final, in input line order.

    `cancelled` is the error ({code, message}) of a line whose job was cancelled: by the batch's cancel, or its expiry.
    """
    rows = session.execute(
        select(BatchRequest, Job).outerjoin(Job, BatchRequest.job_id == Job.id)
        .where(BatchRequest.batch_id == batch.id).order_by(BatchRequest.line_number)
    ).all()
    outputs, errors = [], []
    for request, job in rows:
        succeeded, line = _result(request, job, batch.endpoint, cancelled)
        (outputs if succeeded else errors).append(json.dumps(line) + "\n")
    return "".join(outputs).encode(), "".join(errors).encode()
