"""The reaper and reconciler: dead workers' jobs go back on the queue, live ones never; lost messages come back once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from core import queue, streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import Job, JobStatus, utcnow
from core.settings import Settings, configure
from engine import SamplingParams
from worker import heartbeat
from worker.engine_service import EngineService
from worker.reaper import Reaper, reenqueue_lost_jobs
from worker.runner import run_job


@pytest.fixture
def fast_reaper(service_settings: Settings) -> Iterator[Settings]:
    """The module's settings with a reaper that confirms a death after 0.05 s."""
    settings = service_settings.model_copy(update={"reaper_interval_s": 0.05})
    configure(settings)
    yield settings
    configure(service_settings)


def _submit(settings: Settings, headers: dict[str, str]) -> str:
    client = TestClient(create_app(settings))
    response = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 3}, headers=headers)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _set(job_id: str, **values: object) -> None:
    with session_factory()() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))
        session.commit()


def _job(job_id: str) -> Job:
    with session_factory()() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _two_passes(reaper: Reaper) -> list[str]:
    first = reaper.run_once()["requeued"]
    assert first == []  # a missing heartbeat is confirmed on a later pass, never on the first
    time.sleep(0.1)
    return reaper.run_once()["requeued"]


def test_a_dead_workers_running_job_is_requeued_and_runs_again(
    fast_reaper: Settings, auth_headers: dict[str, str], service: EngineService
) -> None:
    job_id = _submit(fast_reaper, auth_headers)
    _set(job_id, status=JobStatus.running, worker_id="ghost:1", attempts=1)
    assert job_id in _two_passes(Reaper())
    job = _job(job_id)
    assert job.status is JobStatus.queued and job.worker_id is None
    run_job(job_id, service, SamplingParams)
    job = _job(job_id)
    assert job.status is JobStatus.succeeded and job.attempts == 2


def test_a_live_workers_job_is_never_requeued(fast_reaper: Settings, auth_headers: dict[str, str]) -> None:
    job_id = _submit(fast_reaper, auth_headers)
    _set(job_id, status=JobStatus.running, worker_id=heartbeat.worker_id(), attempts=1)
    heartbeat.beat()
    assert job_id not in _two_passes(Reaper())
    assert _job(job_id).status is JobStatus.running


def test_a_run_taken_away_cannot_record_its_result(fast_reaper: Settings, auth_headers: dict[str, str]) -> None:
    job_id = _submit(fast_reaper, auth_headers)
    _set(job_id, status=JobStatus.running, worker_id="ghost:2", attempts=1)
    _two_passes(Reaper())
    _set(job_id, status=JobStatus.running, worker_id="other:3", attempts=2)
    with session_factory()() as session:
        stale = transition(session, job_id, JobStatus.succeeded, {JobStatus.running},
                           {"worker_id": "ghost:2", "attempts": 1}, output=[])
    assert stale is None and _job(job_id).status is JobStatus.running


def test_a_queued_job_the_broker_lost_is_reenqueued_once(fast_reaper: Settings, auth_headers: dict[str, str]) -> None:
    lost, kept = _submit(fast_reaper, auth_headers), _submit(fast_reaper, auth_headers)
    client = streams.redis_client()
    broker_lists = queue.broker_queue_keys(queue.JOBS_QUEUE)
    client.delete(*broker_lists)
    queue.enqueue_job(kept, priority=-1000)  # a message on another level than the default is found too
    for job_id in (lost, kept):
        _set(job_id, created_at=utcnow() - timedelta(hours=1))
    with session_factory()() as session:
        assert reenqueue_lost_jobs(session) == [lost]
        assert reenqueue_lost_jobs(session) == []
    assert sum(client.llen(key) for key in broker_lists) == 2
