"""GET /v1/jobs/{id}/events: server-sent events with a job's tokens as generated, then its final state."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api import jobs
from api.auth import CurrentKey, DbSession
from api.disconnect_check import DisconnectCheck
from api.errors import ApiError
from api.job_follow import DeletedEvent, RestartEvent, TokenEvent, follow_job
from api.schemas import JobOut

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _sse(event: str, data: str, event_id: str | None = None) -> str:
    prefix = f"id: {event_id}\n" if event_id else ""
    return f"{prefix}event: {event}\ndata: {data}\n\n"


async def _events(request: Request, job_id: str, last_id: str) -> AsyncIterator[str]:
    disconnect = DisconnectCheck(request)
    async with aclosing(follow_job(job_id, last_id)) as events:
        async for event in events:
            if await disconnect.gone():
                return
            if event is None:
                yield ": keep-alive\n\n"
            elif isinstance(event, TokenEvent):
                yield _sse("token", json.dumps(event.delta), event.entry_id)
            elif isinstance(event, RestartEvent):
                yield _sse("restart", json.dumps({"attempt": event.attempt}), event.entry_id)
            elif isinstance(event, DeletedEvent):  # by DELETE /v1/jobs/{id}, while this stream followed it
                yield _sse("deleted", json.dumps({"id": job_id}), event.entry_id)
            else:
                yield _sse("done", JobOut.model_validate(event.job).model_dump_json(), event.entry_id)


@router.get("/{job_id}/events", response_class=StreamingResponse)
async def job_events(
    job_id: str,
    request: Request,
    key: CurrentKey,
    session: DbSession,
    last_event_id: Annotated[str | None, Header(pattern=r"^\d+-\d+$")] = None,
) -> StreamingResponse:
    """Stream `token` events ({index, text, token_ids} deltas) and one final `done` event with the job (`deleted`
    instead when the job is deleted meanwhile)."""
    if last_event_id and any(int(part) >= 1 << 64 for part in last_event_id.split("-")):
        raise ApiError(422, "Last-Event-ID must be the id of an event this stream sent (<ms>-<seq>, each below "
                       "2**64)", "Last-Event-ID")
    await run_in_threadpool(jobs.get_job, session, key, job_id)
    # A stream can last minutes: it must not keep a pooled connection (follow_job reads in short sessions).
    await run_in_threadpool(session.close)
    return StreamingResponse(
        _events(request, job_id, last_event_id or "0-0"),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
