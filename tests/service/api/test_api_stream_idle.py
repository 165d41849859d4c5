"""An OpenAI stream waiting for its first token sends nothing but `data:` lines (parsers copied from vLLM's older
benchmark scripts json-decode every line), and still notices a client that went away while nothing was sent."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from api.app import create_app
from core.settings import Settings, configure
from tests.service.procs import served, wait_until


@pytest.fixture(scope="module")
def api_url(service_settings: Settings) -> Iterator[str]:
    """Base URL of a real uvicorn server and no worker: a job waits for its first token for as long as it is open."""
    with served(create_app(service_settings)) as url:
        yield url
    configure(service_settings)


def test_an_idle_stream_sends_only_data_lines_and_is_cancelled_when_its_client_leaves(
    api_url: str, auth_headers: dict[str, str]
) -> None:
    with httpx.Client(base_url=api_url, headers=auth_headers, timeout=30) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        prompt = f"idle stream {time.time_ns()}"
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True}
        received: list[str] = []
        # the role chunk, then nothing at all while no worker runs the job: not even a comment in 2.5 idle seconds
        with client.stream("POST", "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=2.5)) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                for line in response.iter_lines():
                    received.append(line)
        assert received[0].startswith("data: ") and all(line.startswith("data: ") or not line for line in received)

        def cancelled() -> bool:
            jobs = client.get("/v1/jobs").json()["data"]
            return any(job["messages"][0]["content"] == prompt and job["status"] == "cancelled" for job in jobs)

        wait_until(cancelled, 15, "the abandoned stream's job to be cancelled")
