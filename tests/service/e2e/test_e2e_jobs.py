"""The whole service: API and worker processes, real Redis and store, the tiny model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from sqlalchemy import select

from api.auth import find_api_key
from core.db import session_factory
from core.models import Job
from tests.service.e2e.support import offline_greedy, wait_final
from tests.service.procs import wait_until
from tests.service.receiver import WebhookReceiver
from worker import heartbeat, webhooks

PROMPTS = [f"Job {i}: write about the number {i * 7}" for i in range(32)]
MAX_TOKENS = 12


def test_32_concurrent_jobs_match_offline_greedy_and_were_batched(
    live_api: str, auth_headers: dict[str, str], service_model_dir: Path
) -> None:
    with httpx.Client(base_url=live_api, headers=auth_headers, timeout=60) as client:
        body = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        with ThreadPoolExecutor(max_workers=16) as pool:
            submitted = list(pool.map(lambda p: client.post("/v1/jobs", json={**body, "prompt": p}), PROMPTS))
        assert {r.status_code for r in submitted} == {202}
        jobs = [wait_final(client, r.json()["id"]) for r in submitted]
    assert {job["status"] for job in jobs} == {"succeeded"}
    assert [job["choices"][0]["token_ids"] for job in jobs] == offline_greedy(service_model_dir, PROMPTS, MAX_TOKENS)
    # the worker publishes its stats about once a second, so the latest snapshot may predate the jobs
    with session_factory()() as session:  # tenants are not shown worker ids; the store has them
        worker_id = session.scalar(select(Job.worker_id).where(Job.id == jobs[0]["id"]))
    wait_until(lambda: (heartbeat.read_stats(worker_id) or {}).get("peak_num_running", 0) > 1,
               timeout_s=10, what="stats showing more than one job running at once")


def test_events_stream_yields_the_tokens_of_the_final_output(live_api: str, auth_headers: dict[str, str]) -> None:
    with httpx.Client(base_url=live_api, headers=auth_headers, timeout=60) as client:
        job_id = client.post("/v1/jobs", json={"prompt": "Stream this", "max_tokens": 20}).json()["id"]
        token_ids, text, event = [], "", None
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event == "token":
                    delta = json.loads(line.removeprefix("data: "))
                    token_ids += delta["token_ids"]
                    text += delta["text"]
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded"
    assert token_ids == job["choices"][0]["token_ids"] and text == job["text"]


def test_webhook_is_signed_and_retried_after_a_500(
    live_api: str, auth_headers: dict[str, str], webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [500]
    with httpx.Client(base_url=live_api, headers=auth_headers, timeout=60) as client:
        body = {"prompt": "Call me back", "max_tokens": 4, "webhook_url": webhook_receiver.url}
        job_id = client.post("/v1/jobs", json=body).json()["id"]

        def delivered() -> bool:
            deliveries = client.get(f"/v1/jobs/{job_id}/webhooks").json()
            return bool(deliveries) and deliveries[0]["status"] == "delivered"

        wait_until(delivered, 60, "the webhook to be delivered")
        (delivery,) = client.get(f"/v1/jobs/{job_id}/webhooks").json()
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 200]
    assert len(webhook_receiver.received) == 2
    with session_factory()() as session:
        key = find_api_key(session, auth_headers["Authorization"].removeprefix("Bearer "))
        assert key is not None
    for request in webhook_receiver.received:
        headers = request.headers
        assert webhooks.verify(key.webhook_secret, headers["X-Pagedserve-Timestamp"],
                               request.body, headers["X-Pagedserve-Signature"])
        assert json.loads(request.body)["job"]["status"] == "succeeded"


def test_cancelling_a_running_job_through_the_api(live_api: str, auth_headers: dict[str, str]) -> None:
    with httpx.Client(base_url=live_api, headers=auth_headers, timeout=60) as client:
        body = {"prompt": "Keep going", "max_tokens": 400, "ignore_eos": True}
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["first_token_at"] is not None, 60,
                   "the job to start generating")
        assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        job = wait_final(client, job_id)
        assert job["status"] == "cancelled"
        # the worker records what the job generated before the cancel stopped it
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["choices"] is not None, 30,
                   "the cancelled job's partial output")
        job = client.get(f"/v1/jobs/{job_id}").json()
    (choice,) = job["choices"]
    assert job["status"] == "cancelled" and choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 400
