"""GET /v1/jobs/{id}/events: server-sent events with a job's tokens as generated, then its final state."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api import jobs, streams
from api.auth import CurrentKey, DbSession
from api.db import session_factory
from api.models import Job
from api.schemas import JobOut

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
IDLE_CHECK_MS = 1000


def _sse(event: str, data: str, event_id: str | None = None) -> str:
    prefix = f"id: {event_id}\n" if event_id else ""
    return f"{prefix}event: {event}\ndata: {data}\n\n"


def _load_job(job_id: str) -> Job:
    with session_factory()() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _replay_output(job: Job) -> list[str]:
    # The event stream expired (or Redis lost it): the stored output stands in for its tokens.
    return [
        _sse("token", json.dumps({"index": c["index"], "text": c["text"], "token_ids": c["token_ids"]}))
        for c in job.output or []
    ]


async def _events(request: Request, job_id: str, last_id: str) -> AsyncIterator[str]:
    client = streams.async_redis_client()
    stream_key = streams.events_key(job_id)
    try:
        while not await request.is_disconnected():
            reply = await client.xread({stream_key: last_id}, block=IDLE_CHECK_MS, count=512)
            if not reply:
                job = await run_in_threadpool(_load_job, job_id)
                if job.status.is_final:
                    for chunk in _replay_output(job) if last_id == "0-0" else []:
                        yield chunk
                    yield _sse("done", JobOut.model_validate(job).model_dump_json())
                    return
                yield ": keep-alive\n\n"
                continue
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                if fields["type"] == "token":
                    yield _sse("token", fields["data"], entry_id)
                    continue
                job = await run_in_threadpool(_load_job, job_id)
                yield _sse("done", JobOut.model_validate(job).model_dump_json(), entry_id)
                return
    finally:
        await client.aclose()


@router.get("/{job_id}/events", response_class=StreamingResponse)
async def job_events(
    job_id: str,
    request: Request,
    key: CurrentKey,
    session: DbSession,
    last_event_id: Annotated[str | None, Header(pattern=r"^\d+-\d+$")] = None,
) -> StreamingResponse:
    """Stream `token` events ({index, text, token_ids} deltas) and one final `done` event with the job."""
    await run_in_threadpool(jobs.get_job, session, key, job_id)
    return StreamingResponse(
        _events(request, job_id, last_event_id or "0-0"),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
