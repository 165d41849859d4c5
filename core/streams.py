"""Redis connections and a job's two streams: its events (tokens, then the final entry) and its final entry alone."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import redis
import redis.asyncio as aioredis

from core.settings import get_settings

EVENTS_TTL_S = 24 * 3600
FINISHED_EVENTS_TTL_S = 3600
CANCEL_TTL_S = 3600


@lru_cache(maxsize=8)
def _sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, health_check_interval=30)


def redis_client() -> redis.Redis:
    """The process's Redis client for the configured URL."""
    return _sync_client(get_settings().redis_url)


def async_redis_client() -> aioredis.Redis:
    """A new asyncio Redis client (one per event loop user; close it when done)."""
    return aioredis.Redis.from_url(get_settings().redis_url, decode_responses=True)


def key(*parts: str) -> str:
    """A Redis key under the configured prefix."""
    return get_settings().redis_key_prefix + ":".join(parts)


def events_key(job_id: str) -> str:
    """The Redis stream holding a job's events (tokens, then one final event)."""
    return key("job", job_id, "events")


def final_key(job_id: str) -> str:
    """The Redis stream holding only a job's final event (what non-streaming waiters block on)."""
    return key("job", job_id, "final")


def cancel_key(job_id: str) -> str:
    """The Redis flag telling a worker to abort a running job."""
    return key("cancel", job_id)


def publish_tokens(client: redis.Redis, deltas_by_job: dict[str, list[dict[str, Any]]]) -> None:
    """Append token deltas ({index, text, token_ids}) to each job's event stream, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for job_id, deltas in deltas_by_job.items():
        for delta in deltas:
            pipe.xadd(events_key(job_id), {"type": "token", "data": json.dumps(delta)})
        pipe.expire(events_key(job_id), EVENTS_TTL_S)
    pipe.execute()


def publish_restart(client: redis.Redis, job_id: str, attempt: int) -> None:
    """Start a job's event stream afresh for a new attempt (after its worker died).

    Followers already reading get a `restart` entry (discard what they have); new followers see
    only this attempt's tokens.
    """
    pipe = client.pipeline(transaction=True)
    # emptied, not deleted: the stream keeps its last id, so the restart entry's id is past every id a follower has
    # read (a stream made afresh could number it lower, within the same millisecond, and a live follower miss it)
    pipe.xtrim(events_key(job_id), maxlen=0, approximate=False)
    pipe.xadd(events_key(job_id), {"type": "restart", "data": json.dumps({"attempt": attempt})})
    pipe.expire(events_key(job_id), EVENTS_TTL_S)
    pipe.execute()


def publish_final(client: redis.Redis, job_id: str, status: str) -> None:
    """Close a job's event stream with its final status, and put the same entry on its final stream."""
    entry = {"type": "final", "data": json.dumps({"status": status})}
    pipe = client.pipeline(transaction=False)
    for stream_key in (events_key(job_id), final_key(job_id)):
        pipe.xadd(stream_key, entry)
        pipe.expire(stream_key, FINISHED_EVENTS_TTL_S)
    pipe.execute()


def delete_job_streams(client: redis.Redis, job_id: str) -> None:
    """Drop a deleted job's two streams. Its cancel flag stays until it expires: a worker still aborting the job
    (cancelled a moment before) learns of the cancel from it alone."""
    client.delete(events_key(job_id), final_key(job_id))


def request_cancel(client: redis.Redis, job_id: str) -> None:
    """Flag a job so that the worker running it aborts it."""
    client.set(cancel_key(job_id), "1", ex=CANCEL_TTL_S)
