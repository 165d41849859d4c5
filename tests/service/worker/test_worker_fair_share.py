"""Fair share between API keys inside a broker level, with the real Redis, store and engine: a key's backlog
takes one turn per round; a message runs the job fair share picks, passing over entries no longer queued."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from api.app import create_app
from core import fair_queue, queue, streams
from core.db import session_factory
from core.models import Job, JobStatus
from core.settings import Settings
from worker import tasks
from worker.engine_service import EngineService

LEVEL = 7  # the unit tests' level: no job of this module's API tests is queued there


@pytest.fixture
def key() -> Callable[[str], str]:
    """Makes API key ids of the test's own (the module's Redis keys outlive one database's run); same-named ids
    sort in name order."""
    run = uuid.uuid4().hex[:8]
    return lambda name: f"{run}-{name}"


def _pop_all(level: int) -> list[str]:
    popped = []
    while (job_id := fair_queue.pop(level)) is not None:
        popped.append(job_id)
    return popped


def test_keys_take_turns_and_a_key_is_served_in_priority_then_arrival_order(
    service_settings: Settings, key: Callable[[str], str]
) -> None:
    for job_id in ("a1", "a2", "a3"):
        fair_queue.add(LEVEL, key("a"), job_id, 5)
    fair_queue.add(LEVEL, key("a"), "a0", 4)  # more urgent inside key-a's line: served first of key-a's
    fair_queue.add(LEVEL, key("b"), "b1", 5)
    fair_queue.add(LEVEL, key("c"), "c1", 5)
    assert fair_queue.waiting_count(LEVEL) == 6
    # never served keys go first (in name order), then the one served least recently
    assert _pop_all(LEVEL) == ["a0", "b1", "c1", "a1", "a2", "a3"]
    assert fair_queue.waiting_count(LEVEL) == 0


def test_a_key_that_comes_back_keeps_its_last_turn_and_a_new_key_goes_first(
    service_settings: Settings, key: Callable[[str], str]
) -> None:
    fair_queue.add(LEVEL, key("d"), "d1", 0)
    fair_queue.add(LEVEL, key("e"), "e1", 0)
    assert _pop_all(LEVEL) == ["d1", "e1"]
    fair_queue.add(LEVEL, key("e"), "e2", 0)  # served after key-d: key-d goes first when both wait
    fair_queue.add(LEVEL, key("d"), "d2", 0)
    fair_queue.add(LEVEL, key("f"), "f1", 0)  # never served
    assert _pop_all(LEVEL) == ["f1", "d2", "e2"]


def test_an_entry_added_twice_keeps_its_place_and_waiting_names_the_entries_present(
    service_settings: Settings, key: Callable[[str], str]
) -> None:
    assert fair_queue.add(LEVEL, key("g"), "g1", 0) and fair_queue.add(LEVEL, key("g"), "g2", 0)
    assert not fair_queue.add(LEVEL, key("g"), "g1", 0)
    assert fair_queue.waiting([(LEVEL, key("g"), "g1"), (LEVEL, key("g"), "g3"), (LEVEL + 1, key("g"), "g2")]) == {"g1"}
    assert _pop_all(LEVEL) == ["g1", "g2"]


def test_an_entry_whose_key_is_no_longer_listed_at_its_level_is_not_waiting(
    service_settings: Settings, key: Callable[[str], str]
) -> None:
    fair_queue.add(LEVEL, key("i"), "i1", 0)
    streams.redis_client().zrem(streams.key("fair", str(LEVEL), "keys"), key("i"))  # Redis lost the listing
    assert fair_queue.waiting([(LEVEL, key("i"), "i1")]) == set() and fair_queue.pop(LEVEL) is None
    assert not fair_queue.add(LEVEL, key("i"), "i1", 0)  # re-enqueued by the reconciler: listed again
    assert fair_queue.waiting([(LEVEL, key("i"), "i1")]) == {"i1"} and _pop_all(LEVEL) == ["i1"]


def test_a_negative_priority_rank_is_refused_naming_it(service_settings: Settings, key: Callable[[str], str]) -> None:
    with pytest.raises(ValueError, match="priority_rank must be 0 or more, got -1"):
        fair_queue.add(LEVEL, key("h"), "h1", -1)


def _submit(client: TestClient, headers: dict[str, str], **body: object) -> str:
    response = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 2, **body}, headers=headers)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _status(job_id: str) -> JobStatus:
    with session_factory()() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.status


def test_another_keys_job_runs_with_the_next_message_not_after_the_backlog(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str],
    new_auth_headers: Callable[..., dict[str, str]],
) -> None:
    client = TestClient(create_app(service_settings))
    backlog = [_submit(client, auth_headers) for _ in range(4)]
    other = _submit(client, new_auth_headers("other"))
    # the messages of the backlog's first two jobs: the broker hands them out first
    tasks.run_job(backlog[0], queue.MIDDLE_LEVEL)
    tasks.run_job(backlog[1], queue.MIDDLE_LEVEL)
    assert _status(other) is JobStatus.succeeded
    assert [_status(job_id) for job_id in backlog].count(JobStatus.succeeded) == 1
    for job_id in backlog[2:] + [other]:  # the remaining messages run the rest; the last finds its own job done
        tasks.run_job(job_id, queue.MIDDLE_LEVEL)
    assert {_status(job_id) for job_id in backlog} == {JobStatus.succeeded}


def test_a_cancelled_queued_job_leaves_its_keys_line_and_the_key_leaves_the_level_with_it(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str],
    new_auth_headers: Callable[..., dict[str, str]],
) -> None:
    client = TestClient(create_app(service_settings))
    cancelling = new_auth_headers("cancelling")
    cancelled, kept = _submit(client, cancelling), _submit(client, auth_headers)
    assert fair_queue.waiting_count(queue.MIDDLE_LEVEL) == 2
    assert client.post(f"/v1/jobs/{cancelled}/cancel", headers=cancelling).status_code == 200
    assert fair_queue.waiting_count(queue.MIDDLE_LEVEL) == 1
    assert fair_queue.pop(queue.MIDDLE_LEVEL) == kept  # whichever key was due: the cancelling key left the level
    tasks.run_job(cancelled, queue.MIDDLE_LEVEL)  # its message: nothing waits, and its own job is cancelled
    tasks.run_job(kept, queue.MIDDLE_LEVEL)  # the popped entry's job still runs through its own message
    assert _status(kept) is JobStatus.succeeded and _status(cancelled) is JobStatus.cancelled


def test_a_message_passes_over_entries_of_jobs_no_longer_queued(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str],
) -> None:
    client = TestClient(create_app(service_settings))
    stale, kept = _submit(client, auth_headers), _submit(client, auth_headers)
    with session_factory()() as session:  # cancelled while Redis was down: its entry stayed in line
        session.execute(update(Job).where(Job.id == stale).values(status=JobStatus.cancelled))
        session.commit()
    tasks.run_job(stale, queue.MIDDLE_LEVEL)
    assert _status(kept) is JobStatus.succeeded and _status(stale) is JobStatus.cancelled
    tasks.run_job(kept, queue.MIDDLE_LEVEL)  # nothing waits: it falls back to its own job, done already
    assert fair_queue.waiting_count(queue.MIDDLE_LEVEL) == 0


def test_a_message_without_a_level_runs_its_own_job(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str],
) -> None:
    client = TestClient(create_app(service_settings))
    first, second = _submit(client, auth_headers), _submit(client, auth_headers)
    tasks.run_job(second)  # as queued before fair share: the job it names, not the first in line
    assert _status(second) is JobStatus.succeeded and _status(first) is JobStatus.queued
    tasks.run_job(first, queue.MIDDLE_LEVEL)
    assert _status(first) is JobStatus.succeeded
    assert fair_queue.pop(queue.MIDDLE_LEVEL) == second  # its entry was left behind, to be passed over
