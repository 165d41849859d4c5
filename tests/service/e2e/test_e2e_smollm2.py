"""The service with the real default model (SmolLM2-135M-Instruct): chat jobs through API and worker."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.service.e2e.support import offline_greedy, wait_final

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The first planet from the sun is"]


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """PostgreSQL only: one store is enough to show the real model end to end."""
    return postgresql_url


@pytest.fixture(scope="module")
def service_model_dir(smollm2_dir: Path) -> Path:
    """The default model, converted once into the cache directory."""
    return smollm2_dir


def test_smollm2_jobs_match_offline_greedy(live_api: str, auth_headers: dict[str, str], smollm2_dir: Path) -> None:
    with httpx.Client(base_url=live_api, headers=auth_headers, timeout=60) as client:
        ids = [client.post("/v1/jobs", json={"prompt": p, "max_tokens": 12, "temperature": 0.0}).json()["id"]
               for p in PROMPTS]
        jobs = [wait_final(client, job_id, timeout_s=300) for job_id in ids]
        chat = client.post("/v1/jobs", json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8})
        chat_job = wait_final(client, chat.json()["id"], timeout_s=300)
    assert [job["choices"][0]["token_ids"] for job in jobs] == offline_greedy(smollm2_dir, PROMPTS, 12)
    assert chat_job["status"] == "succeeded" and chat_job["prompt"].startswith("<|im_start|>")
    assert chat_job["completion_tokens"] > 0
