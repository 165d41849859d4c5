"""A tenant whose webhook receiver never answers holds no job slot: real API and worker processes, a worker with
two slots, and more deliveries hanging than it has slots."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from core.settings import Settings, configure
from tests.service.procs import wait_until
from tests.service.receiver import WebhookReceiver


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings) -> Iterator[Settings]:
    """Two job slots, and attempts that would wait on the receiver for minutes."""
    settings = service_settings.model_copy(update={"max_num_seqs": 2, "webhook_timeout_s": 300.0,
                                                   "webhook_concurrency": 4, "webhook_concurrency_per_key": 2})
    configure(settings)
    yield settings
    configure(service_settings)


def _status(live_api: str, headers: dict[str, str], job_id: str) -> str:
    return str(httpx.get(f"{live_api}/v1/jobs/{job_id}", headers=headers).json()["status"])


def test_jobs_run_while_a_tenants_webhooks_hang(
    live_api: str, auth_headers: dict[str, str], new_auth_headers: Callable[..., dict[str, str]]
) -> None:
    receiver = WebhookReceiver(held=True).start()
    try:
        hooked = {"prompt": "Hi", "max_tokens": 2, "webhook_url": receiver.url}
        created = httpx.post(f"{live_api}/v1/jobs/batch", json={"jobs": [hooked] * 6}, headers=auth_headers)
        assert created.status_code == 202, created.text
        # their jobs end and their deliveries hang, two at a time (the key's share of the delivery threads)
        wait_until(lambda: receiver.most_at_once == 2, 60, "two deliveries held by the receiver")
        other = new_auth_headers("other-tenant")
        job = httpx.post(f"{live_api}/v1/jobs", json={"prompt": "Hello", "max_tokens": 4}, headers=other)
        job_id = job.json()["id"]
        # on the job slots' own threads these six hanging attempts would hold both slots for the 300 s deadline
        wait_until(lambda: _status(live_api, other, job_id) == "succeeded", 60, "the other tenant's job")
        assert receiver.most_at_once == 2
    finally:
        receiver.stop()
