"""Worker identity and liveness: each worker keeps a short-lived Redis hash with its engine stats."""

from __future__ import annotations

import json
import os
import socket
import time
from functools import lru_cache
from typing import Any

from api import streams

HEARTBEAT_TTL_S = 15


@lru_cache(maxsize=1)
def worker_id() -> str:
    """This worker process's id: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def heartbeat_key(worker: str) -> str:
    """The Redis key of a worker's heartbeat."""
    return streams.key("worker", worker)


def beat(stats: dict[str, Any]) -> None:
    """Record that this worker is alive, with its latest engine stats."""
    client = streams.redis_client()
    key = heartbeat_key(worker_id())
    client.hset(key, mapping={"stats": json.dumps(stats), "updated_at": f"{time.time():.3f}"})
    client.expire(key, HEARTBEAT_TTL_S)


def is_alive(worker: str) -> bool:
    """Whether a worker has beaten within the heartbeat TTL."""
    return bool(streams.redis_client().exists(heartbeat_key(worker)))


def read_stats(worker: str) -> dict[str, Any] | None:
    """A worker's last reported engine stats, or None when it is not alive."""
    raw = streams.redis_client().hget(heartbeat_key(worker), "stats")
    return json.loads(raw) if raw else None
