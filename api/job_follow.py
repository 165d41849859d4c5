"""Following a job's streams in Redis: its token deltas as generated then the job in its final state, or that alone."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis
from starlette.concurrency import run_in_threadpool

from api.stream_fanin import fan_in
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


@dataclass(frozen=True, slots=True)
class DeletedEvent:
    """The job was deleted (DELETE /v1/jobs/{id}) while it was followed; always the last event."""

    job_id: str
    entry_id: str | None = None


def load_job(job_id: str) -> Job | None:
    """A job as the store has it now (in a short session of its own); None once it was deleted."""
    with session_factory()() as session:
        return session.get(Job, job_id)


class _Received:
    """What a follower has yielded of each completion's text and tokens, so that a delta published twice (a retry
    after Redis failed to answer) yields only its new part, and the end makes up what never arrived."""

    def __init__(self, from_start: bool) -> None:
        self.from_start = from_start  # following from the first entry: a completion with no delta yet has nothing
        self.ends: dict[int, tuple[int, int]] = {}  # completion index: (characters, tokens) yielded

    def new_part(self, delta: dict[str, Any]) -> dict[str, Any] | None:
        """The delta less what was yielded already; None when nothing is left."""
        index, text, token_ids = delta["index"], delta["text"], delta["token_ids"]
        known = self.ends.get(index, (0, 0) if self.from_start else None)
        # a delta without offsets (from an older worker) follows what came before it
        text_at = delta.get("text_offset", known[0] if known else 0)
        token_at = delta.get("token_offset", known[1] if known else 0)
        have_text, have_tokens = known or (text_at, token_at)
        skip_text, skip_tokens = max(0, have_text - text_at), max(0, have_tokens - token_at)
        self.ends[index] = (max(have_text, text_at + len(text)), max(have_tokens, token_at + len(token_ids)))
        if skip_text == skip_tokens == 0:
            return delta
        if skip_text >= len(text) and skip_tokens >= len(token_ids):
            return None
        part = {**delta, "text": text[skip_text:], "token_ids": token_ids[skip_tokens:],
                "text_offset": text_at + skip_text, "token_offset": token_at + skip_tokens}
        if "logprobs" in delta:
            part["logprobs"] = delta["logprobs"][skip_tokens:]
        return part

    def missing(self, job: Job) -> list[TokenEvent]:
        """The end of each completion that no delta brought (Redis lost it, or the stream expired), from the stored
        output; all of it for a completion never heard of when following from the start."""
        events = []
        for c in job.output or []:
            if c["index"] not in self.ends and not self.from_start:
                continue
            text_at, token_at = self.ends.get(c["index"], (0, 0))
            if len(c["text"]) <= text_at and len(c["token_ids"]) <= token_at:
                continue
            delta = {"index": c["index"], "text": c["text"][text_at:], "token_ids": c["token_ids"][token_at:],
                     "text_offset": text_at, "token_offset": token_at}
            if c.get("logprobs") is not None:
                delta["logprobs"] = c["logprobs"][token_at:]
            events.append(TokenEvent(delta))
        return events


async def _received_before(stream_key: str, last_id: str) -> _Received:
    """What a follower resuming after `last_id` had received: the token entries up to it, since the last restart
    (all of it past the final entry; nothing known when the stream is gone)."""
    if last_id == "0-0":
        return _Received(from_start=True)
    client = streams.async_redis_client()
    try:
        entries = await client.xrange(stream_key, "-", last_id)
    except redis.exceptions.RedisError:  # unknown: only what comes from now on is sent, and the end from the store
        return _Received(from_start=False)
    finally:
        await client.aclose()
    received = _Received(from_start=bool(entries))
    for _, fields in entries:
        if fields["type"] == "restart":
            received = _Received(from_start=True)
        elif fields["type"] == "token":
            received.new_part(json.loads(fields["data"]))
        else:  # past the final entry: the follower had it all, what was made up before it too
            received = _Received(from_start=False)
    return received


async def follow_job(
    job_id: str, last_id: str = "0-0"
) -> AsyncIterator[TokenEvent | RestartEvent | FinalEvent | DeletedEvent | None]:
    """Yield a job's events after `last_id`, and None after each idle second (a chance to send a keep-alive).
    The token events, joined, are the job's output (from `last_id` on): a delta that came twice yields only its new
    part, and what never came is made up from the stored output before the final event."""
    stream_key = streams.events_key(job_id)
    async with fan_in().subscribe(stream_key, last_id) as subscription:
        received = await _received_before(stream_key, last_id)
        while True:
            entries = await subscription.next(IDLE_CHECK_MS)
            if not entries:
                job = await run_in_threadpool(load_job, job_id)
                if job is None:
                    yield DeletedEvent(job_id)
                    return
                if job.status.is_final:
                    for event in received.missing(job):
                        yield event
                    yield FinalEvent(job)
                    return
                yield None
                continue
            for entry_id, fields in entries:
                if fields["type"] == "token":
                    if (part := received.new_part(json.loads(fields["data"]))) is not None:
                        yield TokenEvent(part, entry_id)
                    continue
                if fields["type"] == "restart":
                    received = _Received(from_start=True)
                    yield RestartEvent(json.loads(fields["data"])["attempt"], entry_id)
                    continue
                job = await run_in_threadpool(load_job, job_id)
                if job is None:
                    yield DeletedEvent(job_id, entry_id)
                    return
                for event in received.missing(job):
                    yield event
                yield FinalEvent(job, entry_id)
                return


async def follow_final(job_id: str, idle_ms: int = IDLE_CHECK_MS) -> AsyncIterator[FinalEvent | DeletedEvent | None]:
    """Yield None after each idle `idle_ms` (a chance to check the client), then the job once final (or that it
    was deleted).

    Follows the job's final stream alone, so its tokens wake nothing.
    """
    next_store_check = 0.0
    async with fan_in().subscribe(streams.final_key(job_id)) as subscription:
        while True:
            if not await subscription.next(idle_ms):
                if time.monotonic() < next_store_check:
                    yield None
                    continue
                # Redis may have lost the final entry, or never got it (it was down when the job ended)
                next_store_check = time.monotonic() + FINAL_RECHECK_S
            job = await run_in_threadpool(load_job, job_id)
            if job is None:
                yield DeletedEvent(job_id)
                return
            if job.status.is_final:
                yield FinalEvent(job)
                return
            yield None  # an entry the store contradicts: the subscription has read past it
