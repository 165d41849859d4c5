"""/v1/jobs: submit, batch-submit, read, list, cancel, delete, and webhook deliveries of a job."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status

from api import jobs
from api.auth import CurrentKey, DbSession
from api.errors import ApiError
from api.schemas import JobBatchCreate, JobBatchOut, JobDeleted, JobList, JobOut, JobRequest, WebhookDeliveryOut
from core.models import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=JobOut)
def submit_job(
    body: JobRequest,
    key: CurrentKey,
    session: DbSession,
    response: Response,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
) -> JobOut:
    """Accept a generation job; a repeated Idempotency-Key with the same body returns the same job (200)."""
    job, created = jobs.create_job(session, key, body, idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
    return JobOut.model_validate(job)


@router.post("/batch", status_code=status.HTTP_202_ACCEPTED, response_model=JobBatchOut)
def submit_jobs(body: JobBatchCreate, key: CurrentKey, session: DbSession) -> JobBatchOut:
    """Accept many jobs at once, all or nothing."""
    created = jobs.create_jobs(session, key, body.jobs)
    return JobBatchOut(data=[JobOut.model_validate(job) for job in created])


@router.get("", response_model=JobList)
def list_jobs(
    key: CurrentKey,
    session: DbSession,
    status_filter: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    ids: Annotated[str | None, Query(max_length=64 * jobs.MAX_BULK_IDS, description="comma-separated job ids")] = None,
) -> JobList:
    """The caller's jobs, newest first, optionally filtered by status; with ids, exactly those jobs in that order."""
    if ids is not None:  # a client polling many jobs at once, in one request
        if status_filter is not None or cursor is not None:
            raise ApiError(422, "ids cannot be combined with status or cursor", "ids")
        return JobList(data=[JobOut.model_validate(job) for job in jobs.get_jobs(session, key, ids)], next_cursor=None)
    page, next_cursor = jobs.list_jobs(session, key, status_filter, limit, cursor)
    return JobList(data=[JobOut.model_validate(job) for job in page], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job_id: str, key: CurrentKey, session: DbSession) -> JobOut:
    """One of the caller's jobs."""
    return JobOut.model_validate(jobs.get_job(session, key, job_id))


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel_job(job_id: str, key: CurrentKey, session: DbSession) -> JobOut:
    """Cancel a queued or running job (409 when it already finished)."""
    return JobOut.model_validate(jobs.cancel_job(session, key, job_id))


@router.delete("/{job_id}", response_model=JobDeleted)
def delete_job(job_id: str, key: CurrentKey, session: DbSession) -> JobDeleted:
    """Delete a finished job with its output and webhook deliveries (409 while it is queued or running)."""
    jobs.delete_job(session, jobs.get_job(session, key, job_id), f"job {job_id}", "job_id", f"/v1/jobs/{job_id}/cancel")
    return JobDeleted(id=job_id)


@router.get("/{job_id}/webhooks", response_model=list[WebhookDeliveryOut])
def list_deliveries(job_id: str, key: CurrentKey, session: DbSession) -> list[WebhookDeliveryOut]:
    """Webhook deliveries of a job with every attempt made."""
    job = jobs.get_job(session, key, job_id)
    return [WebhookDeliveryOut.model_validate(d) for d in job.deliveries]
