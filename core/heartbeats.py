"""Workers' heartbeats in Redis as everyone reads them: the key of each, who is alive, their last stats.

Workers write them (worker/heartbeat.py); /readyz, the reaper and the runner read them here, so the
API needs nothing from the worker package.
"""

from __future__ import annotations

import json
from typing import Any

from core import streams


def heartbeat_key(worker: str) -> str:
    """The Redis key of a worker's heartbeat."""
    return streams.key("worker", worker)


def is_alive(worker: str) -> bool:
    """Whether a worker has beaten within the heartbeat TTL."""
    return bool(streams.redis_client().exists(heartbeat_key(worker)))


def read_stats(worker: str) -> dict[str, Any] | None:
    """A worker's last reported engine stats, or None when it is not alive."""
    raw = streams.redis_client().hget(heartbeat_key(worker), "stats")
    return json.loads(raw) if raw else None


def live_workers(model: str) -> list[str]:
    """Ids of the workers serving `model` whose heartbeat has not expired."""
    client = streams.redis_client()
    prefix = heartbeat_key("")
    keys = list(client.scan_iter(match=heartbeat_key("*"), count=1000))
    models = [client.hget(key, "model") for key in keys]
    return sorted(key.removeprefix(prefix) for key, served in zip(keys, models) if served == model)
