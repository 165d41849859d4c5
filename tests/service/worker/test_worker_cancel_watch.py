"""The cancel watcher, against the real Redis: a pass stops exactly the jobs whose cancel flag is set and releases
their threads; a Redis error costs one pass, not the watcher; an overdue drain stops every job, Redis or not."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from core import streams
from core.settings import Settings
from worker import drain
from worker.cancel_watch import CancelWatcher, Stop
from worker.engine_service import RequestHandle
from worker.token_stream import request_id_for

INTERVAL_S = 0.02


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """The store does not matter here: SQLite only."""
    return sqlite_url


@dataclass(slots=True)
class FollowedJob:
    """A job thread like the runner's: registered with the watcher, blocked on its handle's queue."""

    job_id: str
    handle: RequestHandle
    thread: threading.Thread | None = None
    received: list[object] = field(default_factory=list)


class Jobs:
    """Starts job threads under a watcher; releases the ones still blocked and stops the watchers afterwards."""

    def __init__(self) -> None:
        self.aborted: list[str] = []  # the request ids the watcher aborted, in order
        self._jobs: list[FollowedJob] = []
        self._watchers: list[CancelWatcher] = []

    def watcher(self, redis_client: Callable[[], redis.Redis] = streams.redis_client) -> CancelWatcher:
        watcher = CancelWatcher(redis_client, interval_s=INTERVAL_S).start()
        self._watchers.append(watcher)
        return watcher

    def follow(self, watcher: CancelWatcher) -> FollowedJob:
        job_id = f"job_{uuid.uuid4().hex}"
        job = FollowedJob(job_id, RequestHandle(request_id_for(job_id, 1)))
        registered = threading.Event()

        def run() -> None:
            with watcher.watching(job.job_id, job.handle, self.aborted.append):
                registered.set()
                job.received.append(job.handle.outputs.get())

        job.thread = threading.Thread(target=run, daemon=True)
        job.thread.start()
        assert registered.wait(5)
        self._jobs.append(job)
        return job

    def close(self) -> None:
        for job in self._jobs:
            job.handle.outputs.put(None)  # what the engine would send at the end; a released thread ignores it
            assert job.thread is not None
            job.thread.join(5)
        for watcher in self._watchers:
            watcher.stop()


@pytest.fixture
def jobs(service_settings: Settings) -> Iterator[Jobs]:
    """Job threads and watchers for one test, under the module's Redis prefix."""
    tracked = Jobs()
    yield tracked
    tracked.close()


def _released(job: FollowedJob) -> bool:
    assert job.thread is not None
    job.thread.join(5)
    return not job.thread.is_alive()


def _unreachable_redis() -> redis.Redis:
    # Nothing listens on port 1. No retries: redis-py's default (10, backing off up to 1 s each) makes one failed
    # call take 3-5 s, as long as the 5 s the tests wait for a thread's release.
    return redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))


def test_a_set_cancel_flag_aborts_exactly_its_job_and_releases_only_its_thread(jobs: Jobs) -> None:
    watcher = jobs.watcher()
    followed = [jobs.follow(watcher) for _ in range(32)]
    target = followed[7]
    streams.request_cancel(streams.redis_client(), target.job_id)
    assert _released(target) and target.received == [Stop.CANCELLED]
    time.sleep(10 * INTERVAL_S)  # later passes: the flag stays set, but the stopped job is no longer watched
    assert jobs.aborted == [target.handle.request_id]
    others = [job for job in followed if job is not target]
    assert all(job.thread is not None and job.thread.is_alive() and not job.received for job in others)


def test_a_redis_error_costs_one_pass_and_a_later_pass_still_aborts_the_job(
    jobs: Jobs, caplog: pytest.LogCaptureFixture
) -> None:
    clients = [_unreachable_redis()]  # the first pass with a job to check gets it, later passes the real one

    def redis_client() -> redis.Redis:
        return clients.pop() if clients else streams.redis_client()

    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        watcher = jobs.watcher(redis_client=redis_client)
        job = jobs.follow(watcher)
        streams.request_cancel(streams.redis_client(), job.job_id)
        assert _released(job), "the watcher stopped after a failed pass"
    assert job.received == [Stop.CANCELLED] and jobs.aborted == [job.handle.request_id]
    assert any(record.getMessage().startswith("cancel_watch.check_failed") for record in caplog.records)
    assert not clients


def test_an_overdue_drain_stops_every_job_even_while_redis_is_down(
    jobs: Jobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    watcher = jobs.watcher(redis_client=_unreachable_redis)
    followed = [jobs.follow(watcher) for _ in range(3)]
    time.sleep(5 * INTERVAL_S)
    assert not jobs.aborted  # not draining: nothing is stopped
    monkeypatch.setattr(drain, "_deadline_s", time.monotonic() - 1.0)  # draining, and the grace period is over
    assert all(_released(job) and job.received == [Stop.DRAIN_OVERDUE] for job in followed)
    assert sorted(jobs.aborted) == sorted(job.handle.request_id for job in followed)
