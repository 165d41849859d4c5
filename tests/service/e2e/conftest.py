"""End-to-end fixtures: the API and a worker as real processes over the module's store and Redis."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cli.main import settings_env
from core.settings import Settings
from tests.service.procs import free_port, stop, wait_until


@pytest.fixture(scope="module")
def service_model_dir(tiny_model_dir: Path) -> Path:
    """The tiny random Llama with SmolLM2's tokenizer."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def live_api(service_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of an API process and a worker process (`pagedserve api` / `pagedserve worker`)."""
    settings = service_settings.model_copy(update={"port": free_port()})
    env = settings_env(settings)
    logs = tmp_path_factory.mktemp("logs")
    processes = [
        subprocess.Popen([sys.executable, "-m", "cli.main", role], env=env,
                         stdout=open(logs / f"{role}.log", "wb"), stderr=subprocess.STDOUT)
        for role in ("api", "worker")
    ]
    base_url = f"http://127.0.0.1:{settings.port}"
    try:
        wait_until(lambda: httpx.get(f"{base_url}/readyz").status_code == 200, 60, "the API to be ready")
        yield base_url
    finally:
        for process in processes:
            stop(process)


@pytest.fixture(scope="module")
def openai_client(live_api: str, auth_headers: dict[str, str]) -> Iterator[openai.OpenAI]:
    """The official OpenAI client pointed at the live service."""
    token = auth_headers["Authorization"].removeprefix("Bearer ")
    with openai.OpenAI(base_url=f"{live_api}/v1", api_key=token, max_retries=0, timeout=60) as client:
        yield client
