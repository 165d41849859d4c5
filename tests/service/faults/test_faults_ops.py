"""Ops with real processes: /readyz that needs a worker, the worker's healthcheck, JSON logs, job latency from
acceptance, and the worker drain on SIGTERM (running jobs finish within the grace period, or are requeued)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest

from cli.main import settings_env
from core.settings import Settings, configure
from tests.observability.promtext import value
from tests.service.e2e.support import wait_final
from tests.service.faults.conftest import ServiceProcesses
from tests.service.procs import free_port, wait_until

pytestmark = pytest.mark.faults
LONG_JOB = {"prompt": "Drain me gently", "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings) -> Iterator[Settings]:
    """The fault settings, with JSON logs and a /readyz that needs a live worker."""
    settings = service_settings.model_copy(update={"log_format": "json", "readyz_require_worker": True})
    configure(settings)
    yield settings
    configure(service_settings)


@pytest.fixture(scope="module")
def client(service_procs: ServiceProcesses, auth_headers: dict[str, str]) -> Iterator[httpx.Client]:
    """An HTTP client of the module's API process."""
    with httpx.Client(base_url=service_procs.api_url, headers=auth_headers, timeout=30) as http:
        yield http


def _start_worker(procs: ServiceProcesses, **overrides: object) -> tuple[subprocess.Popen[bytes], Settings]:
    settings = procs.settings.model_copy(update={"metrics_port": free_port(), **overrides})
    log = open(procs.logs / f"worker-ops-{len(procs.workers)}.log", "ab")
    worker = subprocess.Popen([sys.executable, "-m", "cli.main", "worker"], env=settings_env(settings),
                              stdout=log, stderr=subprocess.STDOUT)
    procs.workers.append(worker)
    return worker, settings


def _healthcheck(settings: Settings) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.heartbeat"], env=settings_env(settings),
                          capture_output=True, text=True, timeout=60)


def _ready(client: httpx.Client) -> bool:
    return client.get("/readyz").status_code == 200


def _submit(client: httpx.Client, body: dict, count: int = 1) -> list[str]:
    responses = [client.post("/v1/jobs", json=body) for _ in range(count)]
    assert {r.status_code for r in responses} == {202}
    return [r.json()["id"] for r in responses]


def _all_generating(client: httpx.Client, job_ids: list[str]) -> bool:
    return all(client.get(f"/v1/jobs/{j}").json()["first_token_at"] for j in job_ids)


def _sigterm_while_generating(
    procs: ServiceProcesses, client: httpx.Client, grace_s: float, num_jobs: int
) -> tuple[list[str], Settings]:
    """Start a worker with this drain grace, SIGTERM it once all its jobs generate, and see it exit 0."""
    worker, settings = _start_worker(procs, shutdown_grace_s=grace_s)
    wait_until(lambda: _ready(client), 120, "the worker to be ready")
    job_ids = _submit(client, LONG_JOB, count=num_jobs)
    wait_until(lambda: _all_generating(client, job_ids), 90, "every job to be generating")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=120) == 0
    return job_ids, settings


def _wait_seconds(job: dict, since: str, until: str) -> float:
    return (datetime.fromisoformat(job[until]) - datetime.fromisoformat(job[since])).total_seconds()


def test_readyz_is_503_without_a_live_worker_while_jobs_wait_in_the_queue(client: httpx.Client) -> None:
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable", "database": "ok", "redis": "ok", "model": "ok", "worker": "error: unavailable"}
    _submit(client, {"prompt": "Wait for a worker", "max_tokens": 4})
    wait_until(lambda: value(client.get("/metrics").text, "pagedserve_queue_oldest_age_seconds") > 0, 30,
               "the oldest queued job's age to show")


def test_a_worker_makes_readyz_ready_and_job_latency_counts_the_wait_in_the_queue(
    service_procs: ServiceProcesses, client: httpx.Client
) -> None:
    _, settings = _start_worker(service_procs)
    wait_until(lambda: _ready(client), 120, "/readyz to see the worker's heartbeat")
    job = wait_final(client, _submit(client, {"prompt": "Measure me", "max_tokens": 4})[0], timeout_s=60)
    oldest_id = client.get("/v1/jobs").json()["data"][-1]["id"]  # newest first: the job queued before any worker
    queued_job = wait_final(client, oldest_id, timeout_s=60)
    assert {job["status"], queued_job["status"]} == {"succeeded"}
    metrics = httpx.get(f"http://127.0.0.1:{settings.metrics_port}/metrics").text
    model = {"model_name": settings.model}
    assert value(metrics, "pagedserve_job_latency_seconds_count", **model) == 2
    assert value(metrics, "pagedserve_job_time_to_first_token_seconds_count", **model) == 2
    waited_s = _wait_seconds(queued_job, "created_at", "started_at")  # queued before any worker was up
    assert value(metrics, "pagedserve_job_latency_seconds_sum", **model) >= waited_s
    assert value(metrics, "pagedserve_engine_last_step_timestamp_seconds", **model) > 0
    checked = _healthcheck(settings)
    assert checked.returncode == 0, checked.stderr


def test_api_and_worker_log_one_json_object_per_line(service_procs: ServiceProcesses) -> None:
    records = [json.loads(line) for path in sorted(service_procs.logs.iterdir())
               for line in path.read_text().splitlines() if line.startswith("{")]
    events = {record.get("event") for record in records}
    assert {"engine.ready", "job.transition"} <= events
    ready = next(record for record in records if record.get("event") == "engine.ready")
    assert {"timestamp", "levelname", "name", "message", "worker_id", "model"} <= set(ready)
    assert any(record["name"].startswith("uvicorn") for record in records)  # the server's own lines too


def test_sigterm_lets_running_jobs_finish_within_the_grace_period(
    service_procs: ServiceProcesses, client: httpx.Client
) -> None:
    service_procs.stop_all_workers()
    job_ids, settings = _sigterm_while_generating(service_procs, client, grace_s=120.0, num_jobs=4)
    finals = [client.get(f"/v1/jobs/{j}").json() for j in job_ids]
    assert [(job["status"], job["attempts"]) for job in finals] == [("succeeded", 1)] * len(job_ids)
    assert all(len(job["choices"][0]["token_ids"]) == LONG_JOB["max_tokens"] for job in finals)
    assert not _ready(client)  # the drained worker removed its heartbeat on the way out
    unhealthy = _healthcheck(settings)
    assert unhealthy.returncode != 0 and "do not answer" in unhealthy.stderr


def test_sigterm_requeues_jobs_still_running_after_the_grace_period(
    service_procs: ServiceProcesses, client: httpx.Client
) -> None:
    job_ids, _ = _sigterm_while_generating(service_procs, client, grace_s=0.0, num_jobs=16)
    after_drain = {j: client.get(f"/v1/jobs/{j}").json() for j in job_ids}
    requeued = {j for j, job in after_drain.items() if job["status"] == "queued"}
    assert requeued and {job["status"] for job in after_drain.values()} <= {"queued", "succeeded"}
    assert '"reason": "worker shutting down"' in service_procs.logs_text()
    _start_worker(service_procs)
    finals = {j: wait_final(client, j, timeout_s=120) for j in job_ids}
    assert {job["status"] for job in finals.values()} == {"succeeded"}
    assert all(len(job["choices"][0]["token_ids"]) == LONG_JOB["max_tokens"] for job in finals.values())
    assert {j: finals[j]["attempts"] for j in requeued} == dict.fromkeys(requeued, 2)  # started over elsewhere
