"""Answering an OpenAI request from its job: wait for the result, or relay its tokens as stream chunks."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api import jobs
from api.db import session_factory
from api.errors import ApiError
from api.job_follow import FinalEvent, RestartEvent, TokenEvent, follow_job
from api.models import ApiKey, Job, JobStatus
from api.openai_errors import error_object
from api.openai_responses import chunk, delta_choice, final_choices, usage
from api.openai_schemas import CHAT_COMPLETIONS

DISCONNECT_CHECK_S = 0.5


def _cancel_quietly(key: ApiKey, job_id: str) -> None:
    with session_factory()() as session:
        try:
            jobs.cancel_job(session, key, job_id)
        except ApiError:  # it finished meanwhile
            pass


async def cancel_unfinished(key: ApiKey, job_id: str) -> None:
    """Cancel a job whose client went away, even while the calling task is being cancelled."""
    with anyio.CancelScope(shield=True):
        await run_in_threadpool(_cancel_quietly, key, job_id)


def failure(job: Job) -> ApiError | None:
    """Why a final job has no answer for its client, or None when it succeeded."""
    if job.status is JobStatus.succeeded:
        return None
    if job.status is JobStatus.cancelled:
        return ApiError(409, f"job {job.id} was cancelled before it finished", None)
    return ApiError(500, f"job {job.id} failed: {job.error}", None)


async def wait_for_job(request: Request, key: ApiKey, job_id: str, timeout_s: float) -> Job | None:
    """The job once final; None (and the job cancelled) if the client disconnects first; 504 past the timeout."""
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    async with aclosing(follow_job(job_id)) as events:
        async for event in events:
            if isinstance(event, FinalEvent):
                return event.job
            if time.monotonic() >= deadline:
                await cancel_unfinished(key, job_id)
                raise ApiError(504, f"job {job_id} did not finish within {timeout_s:g} s and was cancelled", None)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    await cancel_unfinished(key, job_id)
                    return None
    raise AssertionError("a job's event stream ends with its final event")


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _closing_chunks(job: Job, model: str, endpoint: str, include_usage: bool) -> list[str]:
    problem = failure(job)
    if problem is not None:
        return [_data({"error": error_object(problem.status_code, problem.message, None)})]
    chunks = [_data(chunk(job, model, endpoint, final_choices(job, endpoint)))]
    if include_usage:
        chunks.append(_data({**chunk(job, model, endpoint, []), "usage": usage(job)}))
    return chunks


async def stream_job(
    request: Request, key: ApiKey, job: Job, model: str, endpoint: str, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; a disconnect cancels the job."""
    finished = False
    try:
        if endpoint == CHAT_COMPLETIONS:
            roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                     for i in range(job.params["n"])]
            yield _data(chunk(job, model, endpoint, roles))
        async with aclosing(follow_job(job.id)) as events:
            async for event in events:
                if await request.is_disconnected():
                    return
                if event is None:
                    yield ": keep-alive\n\n"
                elif isinstance(event, TokenEvent):
                    if not event.delta["text"]:  # a token that ends mid-character adds no text yet
                        continue
                    choice = delta_choice(endpoint, event.delta["index"], event.delta["text"])
                    yield _data(chunk(job, model, endpoint, [choice]))
                elif isinstance(event, RestartEvent):
                    # streamed text cannot be taken back: end this stream, the job itself runs on
                    finished = True
                    message = f"job {job.id} restarted after a worker failure; fetch its result when it finishes"
                    yield _data({"error": error_object(503, message, None)})
                    break
                else:
                    finished = True
                    for closing in _closing_chunks(event.job, model, endpoint, include_usage):
                        yield closing
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            await cancel_unfinished(key, job.id)
