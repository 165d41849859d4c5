"""Faults with real processes: a worker SIGKILLed mid-batch, Redis restarted empty, a webhook receiver down."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from datetime import datetime

import httpx
import pytest
import redis
from sqlalchemy import select

from core import streams
from core.db import session_factory
from core.models import Job, JobStatus
from tests.service.e2e.support import wait_final
from tests.service.faults.conftest import ServiceProcesses
from tests.service.faults.servers import PrivateRedis
from tests.service.procs import free_port, wait_until
from tests.service.receiver import WebhookReceiver

pytestmark = pytest.mark.faults
REAP_DEADLINE_S = 30.0


def _running_on(worker_id: str) -> list[str]:
    with session_factory()() as session:
        return list(session.scalars(select(Job.id).where(Job.status == JobStatus.running, Job.worker_id == worker_id)))


def _worker_of(job_id: str) -> str | None:
    with session_factory()() as session:
        return session.scalar(select(Job.worker_id).where(Job.id == job_id))


def _submit_all(client: httpx.Client, bodies: list[dict]) -> list[str]:
    responses = [client.post("/v1/jobs", json=body) for body in bodies]
    assert {r.status_code for r in responses} == {202}, [r.text for r in responses if r.status_code != 202]
    return [r.json()["id"] for r in responses]


def test_sigkilled_worker_jobs_finish_once_on_another_worker(
    service_procs: ServiceProcesses, auth_headers: dict[str, str], webhook_receiver: WebhookReceiver
) -> None:
    doomed = service_procs.start_worker()
    prompt = "Fault-tolerance job number {}"
    bodies = [{"prompt": prompt.format(i), "max_tokens": 240, "ignore_eos": True, "temperature": 0.0,
               "webhook_url": webhook_receiver.url} for i in range(24)]
    with httpx.Client(base_url=service_procs.api_url, headers=auth_headers, timeout=30) as client:
        job_ids = _submit_all(client, bodies)
        jobs = {}

        def all_generating() -> bool:
            jobs.update({j: client.get(f"/v1/jobs/{j}").json() for j in job_ids})
            return all(job["first_token_at"] for job in jobs.values())

        wait_until(all_generating, 90, "every job to be generating on the first worker")
        doomed_id = _worker_of(job_ids[0])  # tenants are not shown worker ids; the store has them
        service_procs.kill_worker(doomed)
        killed_at = time.monotonic()
        in_flight = set(_running_on(doomed_id))
        service_procs.start_worker()
        wait_until(lambda: not _running_on(doomed_id), REAP_DEADLINE_S + 5, "the dead worker's jobs to be requeued")
        requeued_after_s = time.monotonic() - killed_at
        finals = [wait_final(client, job_id, timeout_s=120) for job_id in job_ids]
        deliveries: dict[str, list[dict]] = {}

        def deliveries_settled() -> bool:  # a final job's webhook is sent after it turned final, not with it
            deliveries.update({j: client.get(f"/v1/jobs/{j}/webhooks").json() for j in job_ids})
            return all(d and all(x["status"] != "pending" for x in d) for d in deliveries.values())

        wait_until(deliveries_settled, 60, "every job's webhook delivery to settle")
    assert in_flight and requeued_after_s < REAP_DEADLINE_S
    assert {job["status"] for job in finals} == {"succeeded"}
    assert all(len(job["choices"][0]["token_ids"]) == 240 for job in finals)  # started over, not resumed twice
    assert {job["id"]: job["attempts"] for job in finals if job["id"] in in_flight} == dict.fromkeys(in_flight, 2)
    assert all(_worker_of(job["id"]) != doomed_id for job in finals if job["id"] in in_flight)
    assert all([d["status"] for d in deliveries[j]] == ["delivered"] for j in job_ids)
    restarted = next(job for job in finals if job["id"] in in_flight)
    stream = streams.redis_client().xrange(streams.events_key(restarted["id"]))
    assert stream[0][1]["type"] == "restart"  # the retry's stream does not mix in the dead attempt's tokens
    tokens = [t for _, f in stream if f["type"] == "token" for t in json.loads(f["data"])["token_ids"]]
    assert tokens == restarted["choices"][0]["token_ids"]
    wait_until(lambda: len(webhook_receiver.received) >= len(job_ids), 30, "every webhook to arrive")
    posts = Counter(json.loads(r.body)["job"]["id"] for r in webhook_receiver.received)
    assert posts == Counter(dict.fromkeys(job_ids, 1))
    logs = service_procs.logs_text()
    api_key = auth_headers["Authorization"].removeprefix("Bearer ")  # whole: a random part may be 2 characters
    assert prompt.format(7) not in logs and api_key not in logs


def test_jobs_lost_by_a_redis_restart_are_reenqueued_and_run_once(
    service_procs: ServiceProcesses, auth_headers: dict[str, str], private_redis: PrivateRedis
) -> None:
    service_procs.stop_all_workers()
    body = {"prompt": "Survive the queue", "max_tokens": 8}
    with httpx.Client(base_url=service_procs.api_url, headers=auth_headers, timeout=30) as client:
        in_broker = _submit_all(client, [body] * 5)  # queued in Redis, no worker to take them
        private_redis.kill()
        while_down = _submit_all(client, [body] * 5)  # accepted into the store while Redis is down
        private_redis.start()  # back, and empty
        service_procs.start_worker()
        finals = [wait_final(client, job_id, timeout_s=90) for job_id in in_broker + while_down]
    assert {job["status"] for job in finals} == {"succeeded"}
    assert {job["attempts"] for job in finals} == {1}


def test_webhooks_retry_with_backoff_until_the_receiver_is_back(
    service_procs: ServiceProcesses, auth_headers: dict[str, str]
) -> None:
    service_procs.ensure_worker()
    port, never_port = free_port(), free_port()
    with httpx.Client(base_url=service_procs.api_url, headers=auth_headers, timeout=30) as client:
        body = {"prompt": "Call me", "max_tokens": 2}
        comes_back, never = _submit_all(client, [{**body, "webhook_url": f"http://127.0.0.1:{port}/hook"},
                                                 {**body, "webhook_url": f"http://127.0.0.1:{never_port}/hook"}])

        def attempts(job_id: str) -> list[dict]:
            deliveries = client.get(f"/v1/jobs/{job_id}/webhooks").json()
            return deliveries[0]["attempts"] if deliveries else []

        wait_until(lambda: len(attempts(comes_back)) >= 2, 60, "two failed attempts while the receiver is down")
        receiver = WebhookReceiver(port=port).start()
        try:
            wait_until(lambda: client.get(f"/v1/jobs/{comes_back}/webhooks").json()[0]["status"] == "delivered",
                       30, "the delivery once the receiver is back")
        finally:
            receiver.stop()
        wait_until(lambda: client.get(f"/v1/jobs/{never}/webhooks").json()[0]["status"] == "failed", 60,
                   "the delivery to a receiver that never comes back to fail")
        delivered, failed = attempts(comes_back), client.get(f"/v1/jobs/{never}/webhooks").json()[0]
    assert [a["status_code"] for a in delivered][-1] == 200 and len(receiver.received) == 1
    assert all(a["status_code"] is None and "ConnectError" in a["error"] for a in delivered[:-1])
    assert failed["num_attempts"] == 5 and len(failed["attempts"]) == 5
    times = [a["created_at"] for a in failed["attempts"]]
    gaps = [b - a for a, b in zip(_seconds(times), _seconds(times)[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]  # exponential backoff


def _seconds(timestamps: list[str]) -> list[float]:
    return [datetime.fromisoformat(t).timestamp() for t in timestamps]


def test_jobs_accepted_before_an_api_crash_survive_and_complete(
    service_procs: ServiceProcesses, auth_headers: dict[str, str]
) -> None:
    bodies = [{"prompt": f"Accepted before the crash {i}", "max_tokens": 4} for i in range(6)]
    with httpx.Client(base_url=service_procs.api_url, headers=auth_headers, timeout=30) as client:
        job_ids = _submit_all(client, bodies)
    service_procs.restart_api()
    service_procs.ensure_worker()
    with httpx.Client(base_url=service_procs.api_url, headers=auth_headers, timeout=30) as client:
        finals = [wait_final(client, job_id, timeout_s=120) for job_id in job_ids]
        listed = {job["id"] for job in client.get("/v1/jobs", params={"limit": 100}).json()["data"]}
    assert [job["status"] for job in finals] == ["succeeded"] * len(job_ids)
    assert set(job_ids) <= listed


def test_streams_and_waits_outlive_dropped_redis_connections(
    service_procs: ServiceProcesses, auth_headers: dict[str, str], private_redis: PrivateRedis
) -> None:
    # what a Redis failover or an idle timeout does to the API's followers: every client connection closed at once
    service_procs.ensure_worker()
    base = service_procs.api_url
    body = {"prompt": "Keep following me", "max_tokens": 120, "ignore_eos": True, "temperature": 0.0}
    results: dict[str, object] = {}

    def blocking() -> None:
        results["blocking"] = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 60},
                                         headers=auth_headers, timeout=120)

    waiter = threading.Thread(target=blocking)
    waiter.start()
    chunks: list[dict] = []
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, headers=auth_headers,
                      timeout=120) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                chunks.append({"done": True})
                break
            chunks.append(json.loads(line.removeprefix("data: ")))
            if len(chunks) == 3:
                admin = redis.Redis.from_url(private_redis.url)
                assert admin.client_kill_filter(_type="normal", skip_me=True) > 0
    waiter.join()
    assert chunks[-1] == {"done": True}
    with httpx.Client(base_url=base, headers=auth_headers, timeout=30) as client:
        final = wait_final(client, chunks[0]["id"], timeout_s=90)
    assert final["status"] == "succeeded"
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == final["choices"][0]["text"]
    blocking_answer = results["blocking"]
    assert isinstance(blocking_answer, httpx.Response) and blocking_answer.status_code == 200, blocking_answer
