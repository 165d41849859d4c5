"""The reaper and reconciler: dead workers' jobs go back on the queue, live ones never; lost messages come back once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from core import fair_queue, queue, streams
from core.db import session_factory
from core.lifecycle import transition
from core.models import Job, JobStatus, utcnow
from core.settings import Settings, configure
from engine import SamplingParams
from worker import heartbeat, runner
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


def test_a_dead_holders_job_taken_over_meanwhile_is_not_claimed_again(
    fast_reaper: Settings, auth_headers: dict[str, str], service: EngineService, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _submit(fast_reaper, auth_headers)
    _set(job_id, status=JobStatus.running, worker_id="ghost:4", attempts=1)
    claimable_from = runner._claimable_from

    def taken_over_meanwhile(job: Job) -> set[JobStatus]:
        found = claimable_from(job)  # running: its holder is dead
        _set(job_id, worker_id="other:5", attempts=2)  # meanwhile the reaper requeued it and another worker claimed it
        return found

    monkeypatch.setattr(runner, "_claimable_from", taken_over_meanwhile)
    assert not run_job(job_id, service, SamplingParams)
    job = _job(job_id)
    assert (job.status, job.worker_id, job.attempts) == (JobStatus.running, "other:5", 2)


def test_a_run_taken_away_cannot_record_its_result(fast_reaper: Settings, auth_headers: dict[str, str]) -> None:
    job_id = _submit(fast_reaper, auth_headers)
    _set(job_id, status=JobStatus.running, worker_id="ghost:2", attempts=1)
    _two_passes(Reaper())
    _set(job_id, status=JobStatus.running, worker_id="other:3", attempts=2)
    with session_factory()() as session:
        stale = transition(session, job_id, JobStatus.succeeded, {JobStatus.running},
                           {"worker_id": "ghost:2", "attempts": 1}, output=[])
    assert stale is None and _job(job_id).status is JobStatus.running


def _age(*job_ids: str) -> None:
    for job_id in job_ids:
        _set(job_id, created_at=utcnow() - timedelta(hours=1))


def _messages() -> int:
    return sum(streams.redis_client().llen(key) for key in queue.broker_queue_keys(queue.JOBS_QUEUE))


def _empty_queue() -> None:
    """Drop the messages, entries and queued jobs the module's earlier tests left (they ran without a worker)."""
    streams.redis_client().delete(*queue.broker_queue_keys(queue.JOBS_QUEUE))
    while fair_queue.pop(queue.MIDDLE_LEVEL) is not None:
        pass
    with session_factory()() as session:
        session.execute(update(Job).where(Job.status == JobStatus.queued).values(status=JobStatus.cancelled))
        session.commit()


def test_a_level_that_lost_messages_gets_as_many_as_it_is_short_once(
    fast_reaper: Settings, auth_headers: dict[str, str]
) -> None:
    _empty_queue()
    first, second = _submit(fast_reaper, auth_headers), _submit(fast_reaper, auth_headers)
    streams.redis_client().delete(*queue.broker_queue_keys(queue.JOBS_QUEUE))  # every message lost
    queue.enqueue_job(second, 0, _job(second).api_key_id)  # one comes back; the entry keeps its place
    _age(first, second)
    with session_factory()() as session:
        assert reenqueue_lost_jobs(session) == [first]  # the oldest waiting job is named
        assert reenqueue_lost_jobs(session) == []
    assert _messages() == 2 and fair_queue.waiting_count(queue.MIDDLE_LEVEL) == 2
    assert [fair_queue.pop(queue.MIDDLE_LEVEL), fair_queue.pop(queue.MIDDLE_LEVEL)] == [first, second]


def test_a_queued_job_whose_entry_was_taken_but_never_claimed_is_reenqueued_once(
    fast_reaper: Settings, auth_headers: dict[str, str]
) -> None:
    _empty_queue()
    taken, waiting = _submit(fast_reaper, auth_headers), _submit(fast_reaper, auth_headers)
    assert fair_queue.pop(queue.MIDDLE_LEVEL) == taken  # a worker took the entry and died before its claim
    _age(taken, waiting)
    with session_factory()() as session:
        assert reenqueue_lost_jobs(session) == [taken]
        assert reenqueue_lost_jobs(session) == []
    assert _messages() == 3 and fair_queue.waiting([(queue.MIDDLE_LEVEL, _job(taken).api_key_id, taken)]) == {taken}


def test_a_reaper_looks_for_lost_jobs_once_per_third_of_the_grace_period(
    fast_reaper: Settings, auth_headers: dict[str, str]
) -> None:
    _empty_queue()
    first, second = _submit(fast_reaper, auth_headers), _submit(fast_reaper, auth_headers)
    reaper = Reaper()
    assert fair_queue.pop(queue.MIDDLE_LEVEL) == first
    _age(first)
    assert reaper.run_once()["reenqueued"] == [first]
    assert fair_queue.pop(queue.MIDDLE_LEVEL) == second
    _age(second)
    assert reaper.run_once()["reenqueued"] == []  # 10 s of the default 30 s grace have not passed
    assert Reaper().run_once()["reenqueued"] == [second]
