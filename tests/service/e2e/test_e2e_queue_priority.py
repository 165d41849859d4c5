"""Priority reaches the broker: an urgent job overtakes a backlog of thousands waiting in Redis; inside a level,
API keys share the worker: one key's job overtakes another key's backlog."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from cli.main import settings_env
from core import queue, streams
from core.db import session_factory
from core.models import Job, JobStatus
from core.settings import Settings
from tests.service.procs import stop, wait_until

BACKLOG = 2000
CHUNK = 500


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """PostgreSQL only: thousands of jobs and a worker's threads writing at once."""
    return postgresql_url


@pytest.mark.parametrize(("priority", "level"), [
    (-1000, 0), (-751, 0), (-750, 1), (-251, 2), (-250, 3), (-1, 3), (0, 4), (1, 5), (500, 6), (1000, 8),
])
def test_api_priorities_map_to_broker_levels_in_bands_of_250(priority: int, level: int) -> None:
    assert queue.broker_level(priority) == level


def test_a_priority_outside_the_api_range_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="priority must be between -1000 and 1000, got 1001"):
        queue.broker_level(1001)


def _started_before(job: Job) -> int:
    with session_factory()() as session:
        return session.scalar(select(func.count()).select_from(Job).where(
            Job.id != job.id, Job.started_at.is_not(None), Job.started_at < job.started_at)) or 0


def _started() -> int:
    with session_factory()() as session:
        return session.scalar(select(func.count()).select_from(Job).where(Job.started_at.is_not(None))) or 0


def _start_worker(settings: Settings, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli.main", "worker"], env=settings_env(settings),
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def _count(status: JobStatus) -> int:
    with session_factory()() as session:
        return session.scalar(select(func.count()).select_from(Job).where(Job.status == status)) or 0


def test_an_urgent_job_overtakes_a_backlog_of_thousands(
    service_settings: Settings, auth_headers: dict[str, str], new_auth_headers: Callable[..., dict[str, str]],
    tmp_path: Path
) -> None:
    client = TestClient(create_app(service_settings))
    body = {"prompt": "Hi", "max_tokens": 1}
    for _ in range(BACKLOG // CHUNK):  # no worker runs yet: the whole backlog waits in Redis
        response = client.post("/v1/jobs/batch", json={"jobs": [body] * CHUNK}, headers=auth_headers)
        assert response.status_code == 202, response.text
    trusted = new_auth_headers("trusted", -1000)  # a key the operator lets ask for any priority
    urgent = client.post("/v1/jobs", json={**body, "priority": -1000}, headers=trusted).json()["id"]
    levels = [streams.redis_client().llen(key) for key in queue.broker_queue_keys(queue.JOBS_QUEUE)]
    assert levels[0] == 1 and levels[queue.MIDDLE_LEVEL] == BACKLOG
    worker = _start_worker(service_settings, tmp_path / "worker.log")
    try:
        # stop at the urgent job's end, or once a tenth of the backlog is done (it did not overtake)
        wait_until(lambda: client.get(f"/v1/jobs/{urgent}", headers=trusted).json()["status"] == "succeeded"
                   or _count(JobStatus.succeeded) >= BACKLOG // 10, 120, "the urgent job or a tenth of the backlog")
    finally:
        stop(worker)
    with session_factory()() as session:
        job = session.get(Job, urgent)
        assert job is not None and job.status is JobStatus.succeeded, (job, _count(JobStatus.succeeded))
    # Jobs the worker took with the urgent one may start first (one per engine slot), and on a busy CPU a few more
    # while the urgent one's thread waits its turn; without broker priority it would come after the whole backlog.
    started_before = _started_before(job)
    assert started_before < 2 * service_settings.max_num_seqs, started_before


def test_another_keys_job_overtakes_a_keys_backlog_at_the_same_priority(
    service_settings: Settings, new_auth_headers: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    client = TestClient(create_app(service_settings))
    body = {"prompt": "Hi", "max_tokens": 1}
    flooding, other = new_auth_headers("flooding"), new_auth_headers("other")
    response = client.post("/v1/jobs/batch", json={"jobs": [body] * CHUNK}, headers=flooding)
    assert response.status_code == 202, response.text
    single = client.post("/v1/jobs", json=body, headers=other).json()["id"]
    started_earlier = _started()  # by the module's earlier test, whose unfinished backlog waits too
    worker = _start_worker(service_settings, tmp_path / "worker.log")
    try:
        wait_until(lambda: client.get(f"/v1/jobs/{single}", headers=other).json()["status"] == "succeeded"
                   or _started() - started_earlier >= CHUNK // 5, 120, "the single job or a fifth of the backlog")
    finally:
        stop(worker)
    with session_factory()() as session:
        job = session.get(Job, single)
        assert job is not None and job.status is JobStatus.succeeded, (job, _started() - started_earlier)
    # first in first out would start it after every job waiting (2,000 of two keys); fair share within the first
    # turns of the keys with work waiting, give or take what the worker's threads took with it (as above, a few
    # more on a busy CPU)
    started_before = _started_before(job) - started_earlier
    assert started_before < 2 * service_settings.max_num_seqs, started_before
