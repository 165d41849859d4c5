"""Non-streaming waits: woken by the job's end alone (its final stream), with the store as the fallback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from contextlib import aclosing

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api import job_follow
from api.job_follow import FinalEvent, follow_final
from core import streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import Job, JobStatus
from core.settings import Settings, configure

Timed = list[tuple[float, FinalEvent | None]]
WAITERS = 16


def _running_job(client: TestClient, headers: dict[str, str], prompt: str = "wait for me") -> str:
    job_id = client.post("/v1/jobs", json={"prompt": prompt}, headers=headers).json()["id"]
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
    return job_id


def _publish_token(job_id: str, text: str) -> None:
    streams.publish_tokens(streams.redis_client(), {job_id: [{"index": 0, "text": text, "token_ids": [1]}]})


def _succeed(job_id: str, text: str) -> None:
    output = [{"index": 0, "text": text, "token_ids": [1] * len(text), "finish_reason": "length"}]
    with session_factory()() as session:
        transition(session, job_id, JobStatus.succeeded, {JobStatus.running}, output=output,
                   completion_tokens=len(text))


def _follow(job_id: str, idle_ms: int, for_s: float, meanwhile: Callable[[], None] = lambda: None) -> Timed:
    """What follow_final yields (with when) until the job's FinalEvent or `for_s` seconds, `meanwhile` running."""

    async def collect() -> Timed:
        events: Timed = []
        stop_at = time.monotonic() + for_s
        async with aclosing(follow_final(job_id, idle_ms)) as follower:
            async for event in follower:
                events.append((time.monotonic(), event))
                if isinstance(event, FinalEvent) or time.monotonic() >= stop_at:
                    break
        return events

    other = threading.Thread(target=meanwhile)
    other.start()
    try:
        return asyncio.run(asyncio.wait_for(collect(), timeout=for_s + 5))
    finally:
        other.join()


def _count_store_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    load_job = job_follow.load_job

    def counted(job_id: str) -> Job:
        reads.append(job_id)
        return load_job(job_id)

    monkeypatch.setattr(job_follow, "load_job", counted)
    return reads


def test_tokens_wake_no_waiter_and_the_final_entry_ends_the_wait_at_once(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    job_id = _running_job(client, auth_headers)
    finished_at: list[float] = []

    def generate() -> None:
        for piece in ["a"] * 40:  # one entry per engine step, as the worker publishes them
            _publish_token(job_id, piece)
            time.sleep(0.005)
        finished_at.append(time.monotonic())
        _succeed(job_id, "a" * 40)

    # idle waits of 5 s: neither an idle wake-up nor the store check after it can come before the end
    events = _follow(job_id, idle_ms=5000, for_s=10, meanwhile=generate)
    assert len(events) == 1, f"the waiter woke for tokens: {[e for _, e in events]}"
    arrived_at, final = events[0]
    assert isinstance(final, FinalEvent) and final.job.status is JobStatus.succeeded
    assert final.job.output is not None and final.job.output[0]["text"] == "a" * 40
    assert arrived_at - finished_at[0] < 2.0


def _connections_received() -> int:
    return int(streams.redis_client().info("stats")["total_connections_received"])


def test_many_waiters_share_one_connection_and_each_ends_with_its_job(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    """Non-streaming waits read through the event loop's one shared reader: no connection per request."""
    job_ids = [_running_job(client, auth_headers, f"waiter {i}") for i in range(WAITERS)]

    async def wait_all() -> tuple[list[tuple[float, FinalEvent]], list[float], int]:
        async def wait(job_id: str) -> tuple[float, FinalEvent]:
            # idle waits of 5 s: the store is not asked before then, so only the final entry can end a wait sooner
            async with aclosing(follow_final(job_id, 5000)) as follower:
                async for event in follower:
                    if isinstance(event, FinalEvent):
                        return time.monotonic(), event
            raise AssertionError(f"{job_id} ended without its final event")

        connections_before = await asyncio.to_thread(_connections_received)
        waits = [asyncio.create_task(wait(job_id)) for job_id in job_ids]
        await asyncio.sleep(0.3)  # every waiter is in the shared read
        succeeded_at = {}
        for job_id in reversed(job_ids):
            await asyncio.to_thread(_succeed, job_id, job_id[-4:])
            succeeded_at[job_id] = time.monotonic()
        ended = await asyncio.gather(*waits)
        connections = await asyncio.to_thread(_connections_received) - connections_before
        return ended, [succeeded_at[job_id] for job_id in job_ids], connections

    ended, succeeded_at, connections = asyncio.run(asyncio.wait_for(wait_all(), timeout=30))
    for (ended_at, final), job_succeeded_at in zip(ended, succeeded_at, strict=True):
        assert final.job.status is JobStatus.succeeded and final.job.output[0]["text"] == final.job.id[-4:]
        assert ended_at - job_succeeded_at < 2.0, "a wait ended by the store check, not by its final entry"
    # the reader and its wake-ups: two; a connection per wait would be 16
    assert connections <= 4, f"{connections} new Redis connections for {WAITERS} waits"


def test_an_idle_waiter_asks_the_store_once_not_every_idle_wait(
    client: TestClient, auth_headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_follow, "FINAL_RECHECK_S", 60.0)
    reads = _count_store_reads(monkeypatch)
    events = _follow(_running_job(client, auth_headers), idle_ms=100, for_s=1.0)
    assert len(events) >= 5 and all(event is None for _, event in events)
    assert len(reads) == 1  # after the first idle wait; the next is FINAL_RECHECK_S away


def test_a_final_entry_the_store_contradicts_is_read_once(
    client: TestClient, auth_headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_follow, "FINAL_RECHECK_S", 60.0)
    job_id = _running_job(client, auth_headers)
    streams.publish_final(streams.redis_client(), job_id, "succeeded")  # the store says running
    reads = _count_store_reads(monkeypatch)
    events = _follow(job_id, idle_ms=100, for_s=1.0)
    assert all(event is None for _, event in events)
    assert len(reads) == 2  # for the entry, then after the first idle wait


def test_a_job_final_in_the_store_alone_ends_the_wait_at_the_next_recheck(
    client: TestClient, auth_headers: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_follow, "FINAL_RECHECK_S", 0.5)
    monkeypatch.setattr(streams, "publish_final", lambda *args: None)  # Redis never gets the final entry
    job_id = _running_job(client, auth_headers)

    def finish_after_the_first_store_check() -> None:
        time.sleep(0.4)
        _succeed(job_id, "late")

    events = _follow(job_id, idle_ms=100, for_s=5.0, meanwhile=finish_after_the_first_store_check)
    final = events[-1][1]
    assert isinstance(final, FinalEvent) and final.job.status is JobStatus.succeeded
    assert not streams.redis_client().exists(streams.final_key(job_id))


def test_a_non_streaming_completion_answers_once_its_job_succeeds(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    answers = []
    model = client.get("/v1/models", headers=auth_headers).json()["data"][0]["id"]
    body = {"model": model, "prompt": "answer me", "max_tokens": 4}
    request = threading.Thread(
        target=lambda: answers.append(client.post("/v1/completions", json=body, headers=auth_headers)))
    request.start()
    with session_factory()() as session:
        job_id = None
        for _ in range(100):
            job_id = session.scalar(select(Job.id).where(Job.prompt == "answer me"))
            if job_id is not None:
                break
            time.sleep(0.05)
    assert job_id is not None
    with session_factory()() as session:
        transition(session, job_id, JobStatus.running, {JobStatus.queued})
    for piece in "four":
        _publish_token(job_id, piece)
    _succeed(job_id, "four")
    request.join(timeout=10)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json()["id"] == job_id and answers[0].json()["choices"][0]["text"] == "four"


def test_a_non_streaming_completion_past_the_timeout_is_504_and_its_job_cancelled(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    model = client.get("/v1/models", headers=auth_headers).json()["data"][0]["id"]
    configure(service_settings.model_copy(update={"openai_timeout_s": 1.0}))
    try:
        response = client.post("/v1/completions", json={"model": model, "prompt": "no worker", "max_tokens": 2},
                               headers=auth_headers)
    finally:
        configure(service_settings)
    assert response.status_code == 504, response.text
    with session_factory()() as session:
        statuses = session.scalars(select(Job.status).where(Job.prompt == "no worker")).all()
    assert statuses == [JobStatus.cancelled]


def test_a_wait_whose_loop_stalled_past_the_socket_timeout_reads_again(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    """The event loop held up past the Redis client's 5 s socket timeout (another request's work on it) while a read
    waits: the wait reads again from where it was, instead of failing its request."""
    job_id = _running_job(client, auth_headers, "held up")

    async def collect() -> list[FinalEvent | None]:
        async def stall() -> None:
            await asyncio.sleep(0.3)  # the wait's read is in flight
            time.sleep(6)  # blocks the loop, as a long synchronous call on it would

        staller = asyncio.create_task(stall())
        events: list[FinalEvent | None] = []
        async with aclosing(follow_final(job_id, 1000)) as follower:
            async for event in follower:
                events.append(event)
                if isinstance(event, FinalEvent):
                    break
        await staller
        return events

    def finish_meanwhile() -> None:
        time.sleep(1.0)
        _succeed(job_id, "done")
        streams.publish_final(streams.redis_client(), job_id, "succeeded")

    other = threading.Thread(target=finish_meanwhile)
    other.start()
    try:
        events = asyncio.run(asyncio.wait_for(collect(), timeout=30))
    finally:
        other.join()
    assert isinstance(events[-1], FinalEvent) and events[-1].job.status is JobStatus.succeeded
