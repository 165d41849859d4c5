"""The Celery application shared by the API (to enqueue) and the workers (to consume); no tasks are imported here.

A job's priority reaches the broker: Celery's Redis transport splits each queue into one list per
priority level (0 to 8) and a worker's BRPOP names level 0 of every queue first, so an urgent job
overtakes a backlog of any length, not only the few jobs a worker already holds (those the engine's
own priority scheduling orders). Inside a level, API keys share the workers fairly (core/fair_queue.py).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Celery
from kombu.transport.redis import Channel as RedisChannel

from core import fair_queue
from core.settings import Settings, get_settings

RUN_JOB_TASK = "pagedserve.run_job"
DELIVER_WEBHOOK_TASK = "pagedserve.deliver_webhook"
JOBS_QUEUE = "pagedserve.jobs"
WEBHOOKS_QUEUE = "pagedserve.webhooks"
MAX_PRIORITY = 1000  # the API's priorities run from -MAX_PRIORITY (most urgent) to MAX_PRIORITY
PRIORITY_BAND = 250  # API priorities per broker level on each side of 0
MIDDLE_LEVEL = MAX_PRIORITY // PRIORITY_BAND  # the level of priority 0, the default of interactive jobs
BROKER_LEVELS = list(range(2 * MIDDLE_LEVEL + 1))  # Redis priority levels, 0 taken first
WEBHOOK_LEVEL = 0  # a delivery is cheap and has a deadline: it never waits behind a backlog of jobs


def broker_key_prefix(settings: Settings) -> str:
    """The prefix of every Redis key Celery's transport writes."""
    return settings.redis_key_prefix + "celery:"


def broker_queue_keys(queue_name: str) -> list[str]:
    """The Redis lists holding a queue's messages that no worker has taken yet, one per priority level."""
    base = broker_key_prefix(get_settings()) + queue_name
    # kombu names level 0 without a suffix; its default separator is kept so bindings stored by older workers parse
    return [base] + [f"{base}{RedisChannel.sep}{level}" for level in BROKER_LEVELS[1:]]


def broker_level(priority: int) -> int:
    """The broker level (0 runs first) of an API priority (lower runs earlier); priority 0 is the middle level."""
    # each 250 more or less urgent is one level away: -1..-250 → 3, -751..-1000 → 0, 1..250 → 5, 751..1000 → 8
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY}, got {priority}")
    bands_away = -(-priority // PRIORITY_BAND) if priority > 0 else priority // PRIORITY_BAND  # rounded outwards
    return MIDDLE_LEVEL + bands_away


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings: late acks so a crashed worker's job is redelivered, one prefetch per free slot."""
    transport = {
        "visibility_timeout": settings.broker_visibility_timeout_s,
        "global_keyprefix": broker_key_prefix(settings),
        "unacked_restore_interval": 5,
        # one list per level; BRPOP polls level-major across queues, so levels order jobs and webhooks alike
        "priority_steps": BROKER_LEVELS,
    }
    return {
        "broker_url": settings.redis_url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_ignore_result": True,
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        "task_routes": {RUN_JOB_TASK: {"queue": JOBS_QUEUE}, DELIVER_WEBHOOK_TASK: {"queue": WEBHOOKS_QUEUE}},
        "task_serializer": "json",
        "accept_content": ["json"],
    }


@lru_cache(maxsize=8)
def _celery_for(settings_json: str) -> Celery:
    settings = Settings.model_validate_json(settings_json)
    app = Celery("pagedserve")
    app.conf.update(celery_config(settings))
    return app


def celery_app() -> Celery:
    """The Celery app for the configured Redis."""
    return _celery_for(get_settings().model_dump_json())


def enqueue_job(job_id: str, priority: int, api_key_id: str) -> None:
    """Queue a job at its priority's broker level: an entry in its key's line there, and a message for one run
    at that level (its job id and level); the worker that takes the message runs the job fair share picks."""
    level = broker_level(priority)
    fair_queue.add(level, api_key_id, job_id, priority + MAX_PRIORITY)
    celery_app().send_task(RUN_JOB_TASK, args=[job_id, level], priority=level)


def withdraw_job(job_id: str, priority: int, api_key_id: str) -> None:
    """Take a job that will not run (cancelled) out of its key's line; its message stays, one run at its level."""
    fair_queue.remove(broker_level(priority), api_key_id, job_id)


def enqueue_webhook(delivery_id: str, countdown_s: float = 0.0) -> None:
    """Queue one webhook delivery attempt, optionally after a delay."""
    celery_app().send_task(DELIVER_WEBHOOK_TASK, args=[delivery_id], countdown=countdown_s or None,
                           priority=WEBHOOK_LEVEL)
