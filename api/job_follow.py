"""Following a job's streams in Redis: its token deltas as generated then the job in its final state, or that alone."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from core import streams
from core.db import session_factory
from core.models import Job

IDLE_CHECK_MS = 1000
# How often a final-only follower asks the store, in case Redis lost (or never got) the final entry:
# rarely, since 32 waiters asking every second would cost the CPU that following only the end saves.
FINAL_RECHECK_S = 10.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New text and token ids of one completion ({index, text, token_ids}); entry_id is None when replayed."""

    delta: dict[str, Any]
    entry_id: str | None = None


@dataclass(frozen=True, slots=True)
class RestartEvent:
    """The job started over (attempt `attempt`) after its worker died: earlier tokens are void."""

    attempt: int
    entry_id: str | None = None


@dataclass(frozen=True, slots=True)
class FinalEvent:
    """The job once it reached a final state; always the last event."""

    job: Job
    entry_id: str | None = None


def load_job(job_id: str) -> Job:
    """A job as the store has it now (in a short session of its own)."""
    with session_factory()() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _replayed_tokens(job: Job) -> list[TokenEvent]:
    # The event stream expired (or Redis lost it): the stored output stands in for its tokens.
    return [
        TokenEvent({"index": c["index"], "text": c["text"], "token_ids": c["token_ids"]}
                   | ({"logprobs": c["logprobs"]} if c.get("logprobs") is not None else {}))
        for c in job.output or []
    ]


async def follow_job(
    job_id: str, last_id: str = "0-0"
) -> AsyncIterator[TokenEvent | RestartEvent | FinalEvent | None]:
    """Yield a job's events after `last_id`, and None after each idle second (a chance to send a keep-alive)."""
    client = streams.async_redis_client()
    stream_key = streams.events_key(job_id)
    try:
        while True:
            reply = await client.xread({stream_key: last_id}, block=IDLE_CHECK_MS, count=512)
            if not reply:
                job = await run_in_threadpool(load_job, job_id)
                if job.status.is_final:
                    for event in _replayed_tokens(job) if last_id == "0-0" else []:
                        yield event
                    yield FinalEvent(job)
                    return
                yield None
                continue
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                if fields["type"] == "token":
                    yield TokenEvent(json.loads(fields["data"]), entry_id)
                    continue
                if fields["type"] == "restart":
                    yield RestartEvent(json.loads(fields["data"])["attempt"], entry_id)
                    continue
                yield FinalEvent(await run_in_threadpool(load_job, job_id), entry_id)
                return
    finally:
        await client.aclose()


async def follow_final(job_id: str, idle_ms: int = IDLE_CHECK_MS) -> AsyncIterator[FinalEvent | None]:
    """Yield None after each idle `idle_ms` (a chance to check the client), then the job once final.

    Blocks on the job's final stream alone, so its tokens wake nothing.
    """
    client = streams.async_redis_client()
    stream_key = streams.final_key(job_id)
    last_id, next_store_check = "0-0", 0.0
    try:
        while True:
            reply = await client.xread({stream_key: last_id}, block=idle_ms, count=1)
            if reply:
                last_id = reply[0][1][0][0]  # read past it: an entry the store contradicts is read once
            elif time.monotonic() < next_store_check:
                yield None
                continue
            else:  # Redis may have lost the final entry, or never got it (it was down when the job ended)
                next_store_check = time.monotonic() + FINAL_RECHECK_S
            job = await run_in_threadpool(load_job, job_id)
            if job.status.is_final:
                yield FinalEvent(job)
                return
            yield None
    finally:
        await client.aclose()
