"""Per-API-key limits: requests per second (fixed one-second windows in Redis) and jobs in flight."""

from __future__ import annotations

import logging
import time

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.errors import ApiError
from core import streams
from core.models import ApiKey, Job, JobStatus
from core.settings import get_settings

logger = logging.getLogger("pagedserve.api")
INFLIGHT_RETRY_AFTER_S = 5


def check_request_rate(key: ApiKey) -> None:
    """Count one request of this key; 429 with Retry-After once it passes rate_limit_per_s in this second."""
    limit = get_settings().rate_limit_per_s
    if not limit:
        return
    now = time.time()
    window_key = streams.key("ratelimit", key.id, str(int(now)))
    try:
        pipe = streams.redis_client().pipeline()
        pipe.incr(window_key)
        pipe.expire(window_key, 2)
        count = pipe.execute()[0]
    except redis.RedisError as exc:  # fail open: a Redis outage must not lock every client out
        logger.warning("ratelimit.unavailable error=%s", exc.__class__.__name__)
        return
    if count > limit:
        raise ApiError(429, f"rate limit exceeded: at most {limit} requests per second per API key",
                       headers={"Retry-After": "1"})


def check_inflight(session: Session, key: ApiKey, num_new_jobs: int = 1) -> None:
    """429 with Retry-After when this key's queued and running jobs plus the new ones pass the cap."""
    cap = get_settings().max_inflight_jobs_per_key
    in_flight = session.scalar(select(func.count()).select_from(Job).where(
        Job.api_key_id == key.id, Job.status.in_([JobStatus.queued, JobStatus.running])))
    if (in_flight or 0) + num_new_jobs > cap:
        raise ApiError(
            429, f"too many jobs in flight: {in_flight} queued or running, {num_new_jobs} more asked for, "
                 f"at most {cap} per API key; retry when some finish",
            headers={"Retry-After": str(INFLIGHT_RETRY_AFTER_S)})
