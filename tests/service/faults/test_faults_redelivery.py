"""The broker itself redelivers a running job whose worker died: the message was never acknowledged, so after
the visibility timeout it goes back to the queue and another worker claims and finishes the job."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import httpx
import pytest

from core.settings import Settings, configure
from tests.service.e2e.support import wait_final
from tests.service.faults.conftest import ServiceProcesses
from tests.service.procs import wait_until

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings) -> Iterator[Settings]:
    """A short visibility timeout, and a reaper too slow to act, so only the broker can bring the job back."""
    settings = service_settings.model_copy(update={
        "broker_visibility_timeout_s": 3.0, "heartbeat_ttl_s": 2.0, "reaper_interval_s": 3600.0,
    })
    configure(settings)
    yield settings
    configure(service_settings)


def test_a_running_job_whose_worker_died_is_redelivered_and_finishes_on_another_worker(
    service_procs: ServiceProcesses, auth_headers: dict[str, str]
) -> None:
    doomed = service_procs.start_worker()
    body = {"prompt": "Redeliver me", "max_tokens": 480, "n": 4, "ignore_eos": True, "temperature": 0.0}
    with httpx.Client(base_url=service_procs.api_url, headers=auth_headers, timeout=30) as client:
        response = client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").json()["first_token_at"] is not None, 120,
                   "the job to start generating")
        doomed.send_signal(signal.SIGSTOP)  # frozen mid-job: it can neither finish nor acknowledge
        assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
        service_procs.kill_worker(doomed)
        service_procs.start_worker()
        job = wait_final(client, job_id, timeout_s=120)
    assert job["status"] == "succeeded" and job["attempts"] == 2
    assert [len(choice["token_ids"]) for choice in job["choices"]] == [480] * 4
