"""Worker identity and liveness: each worker keeps a short-lived Redis hash with its model and engine stats.

`python -m worker.heartbeat` is the worker container's healthcheck: it exits non-zero, saying why, when
the worker's metrics do not answer, its engine has held work without stepping for `engine_stall_timeout_s`,
or no heartbeat from this host is fresh (its engine thread and reaper both stopped beating).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request
from functools import lru_cache
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from core import streams

# the readers live below the API and the worker alike; reaper and runner reach them through this module
from core.heartbeats import heartbeat_key, is_alive, live_workers, read_stats  # noqa: F401
from core.settings import get_settings

STALLED_METRIC = "pagedserve_engine_stalled_seconds"


@lru_cache(maxsize=1)
def worker_id() -> str:
    """This worker process's id: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def beat(stats: dict[str, Any] | None = None) -> None:
    """Record that this worker is alive, with its latest engine stats when given."""
    client = streams.redis_client()
    key = heartbeat_key(worker_id())
    fields = {"updated_at": f"{time.time():.3f}", "model": get_settings().model}
    fields |= {"stats": json.dumps(stats)} if stats is not None else {}
    pipe = client.pipeline()
    pipe.hset(key, mapping=fields)
    pipe.pexpire(key, int(get_settings().heartbeat_ttl_s * 1000))
    pipe.execute()


def forget() -> None:
    """Remove this worker's heartbeat at a clean exit, so readiness and the reaper see it gone at once."""
    streams.redis_client().delete(heartbeat_key(worker_id()))


def unhealthy_reason() -> str | None:
    """Why this host's worker is unhealthy (metrics silent, engine stalled, no fresh heartbeat), or None."""
    settings = get_settings()
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=3).read().decode()
    except OSError as exc:
        return f"metrics at {url} do not answer: {exc}"
    stalled_s = max((s.value for f in text_string_to_metric_families(text) if f.name == STALLED_METRIC
                     for s in f.samples), default=0.0)
    if stalled_s > settings.engine_stall_timeout_s:
        return f"the engine holds work and has not stepped for {stalled_s:.0f} s"
    host = socket.gethostname()
    if not any(worker.startswith(host + ":") for worker in live_workers(settings.model)):
        return f"no fresh heartbeat from a {settings.model} worker on {host}"
    return None


if __name__ == "__main__":
    reason = unhealthy_reason()
    if reason is not None:
        sys.exit(f"unhealthy: {reason}")
