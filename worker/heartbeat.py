"""Worker identity and liveness: each worker keeps a short-lived Redis hash with its engine stats."""

from __future__ import annotations

import json
import os
import socket
import time
from functools import lru_cache
from typing import Any

from api import streams
from api.settings import get_settings


@lru_cache(maxsize=1)
def worker_id() -> str:
    """This worker process's id: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def heartbeat_key(worker: str) -> str:
    """The Redis key of a worker's heartbeat."""
    return streams.key("worker", worker)


def beat(stats: dict[str, Any] | None = None) -> None:
    """Record that this worker is alive, with its latest engine stats when given."""
    client = streams.redis_client()
    key = heartbeat_key(worker_id())
    fields = {"updated_at": f"{time.time():.3f}"} | ({"stats": json.dumps(stats)} if stats is not None else {})
    pipe = client.pipeline()
    pipe.hset(key, mapping=fields)
    pipe.pexpire(key, int(get_settings().heartbeat_ttl_s * 1000))
    pipe.execute()


def is_alive(worker: str) -> bool:
    """Whether a worker has beaten within the heartbeat TTL."""
    return bool(streams.redis_client().exists(heartbeat_key(worker)))


def read_stats(worker: str) -> dict[str, Any] | None:
    """A worker's last reported engine stats, or None when it is not alive."""
    raw = streams.redis_client().hget(heartbeat_key(worker), "stats")
    return json.loads(raw) if raw else None
