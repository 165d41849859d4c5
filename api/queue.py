"""The Celery application shared by the API (to enqueue) and the workers (to consume); no tasks are imported here."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Celery

from api.settings import Settings, get_settings

RUN_JOB_TASK = "pagedserve.run_job"
DELIVER_WEBHOOK_TASK = "pagedserve.deliver_webhook"
JOBS_QUEUE = "pagedserve.jobs"
WEBHOOKS_QUEUE = "pagedserve.webhooks"
# Longer than any job may run: a shorter visibility timeout would hand a running job to a second worker.
VISIBILITY_TIMEOUT_S = 6 * 3600


def broker_key_prefix(settings: Settings) -> str:
    """The prefix of every Redis key Celery's transport writes."""
    return settings.redis_key_prefix + "celery:"


def broker_queue_key(queue_name: str) -> str:
    """The Redis list holding a queue's messages that no worker has taken yet."""
    return broker_key_prefix(get_settings()) + queue_name


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings: late acks so a crashed worker's job is redelivered, one prefetch per free slot."""
    transport = {
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        "global_keyprefix": broker_key_prefix(settings),
        "unacked_restore_interval": 5,
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


def enqueue_job(job_id: str) -> None:
    """Queue a job for the workers; the message carries only its id."""
    celery_app().send_task(RUN_JOB_TASK, args=[job_id])


def enqueue_webhook(delivery_id: str, countdown_s: float = 0.0) -> None:
    """Queue one webhook delivery attempt, optionally after a delay."""
    celery_app().send_task(DELIVER_WEBHOOK_TASK, args=[delivery_id], countdown=countdown_s or None)
