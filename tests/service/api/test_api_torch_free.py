"""The API runs without torch: it only reads prepared model folders, and waits (503) for a GGUF to be converted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from cli.main import settings_env
from core.settings import Settings
from tests.service.procs import free_port, stop, wait_until

HEAVY_MODULES = ("torch", "transformers", "engine", "paged_kernels")
# Runs in a fresh interpreter: build the app, accept a job and judge a completion's prompt (the tokenizer's path).
SERVE_WITHOUT_TORCH = """
import sys
from fastapi.testclient import TestClient
from api.app import create_app

client = TestClient(create_app())
auth = {"Authorization": sys.argv[1]}
job = client.post("/v1/jobs", json={"prompt": "the quick fox", "max_tokens": 4}, headers=auth)
assert job.status_code == 202, job.text
too_long = client.post("/v1/completions", json={"model": sys.argv[3], "prompt": "the lazy dog " * 100, "max_tokens": 4},
                       headers=auth)
assert too_long.status_code == 400 and "context" in too_long.text, too_long.text
print(",".join(sorted(name for name in sys.modules if name.split(".")[0] in sys.argv[2].split(","))))
"""


@pytest.fixture(scope="module")
def database_url(postgresql_url: str) -> str:
    """One store is enough: these tests are about the API's imports and model lookup, not the database."""
    return postgresql_url


def test_serving_jobs_and_completions_never_imports_torch_engine_or_kernels(
    service_settings: Settings, new_auth_headers: Callable[[str], dict[str, str]]
) -> None:
    auth = new_auth_headers("torch-free")["Authorization"]
    result = subprocess.run(
        [sys.executable, "-c", SERVE_WITHOUT_TORCH, auth, ",".join(HEAVY_MODULES), service_settings.model],
        env=settings_env(service_settings), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the API process imported {result.stdout.strip()}"


@pytest.fixture
def unprepared_api(service_settings: Settings, tmp_path: Path) -> Iterator[tuple[str, Settings]]:
    """`pagedserve api` serving the built-in GGUF model with an empty cache dir (nothing converted yet)."""
    settings = service_settings.model_copy(update={
        "model": "smollm2-135m-instruct", "cache_dir": tmp_path / "cache", "port": free_port(),
    })
    log = tmp_path / "api.log"
    api = subprocess.Popen([sys.executable, "-m", "cli.main", "api"], env=settings_env(settings),
                           stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{settings.port}"
    try:
        wait_until(lambda: api.poll() is not None or _answers(base_url), 60, "the API to answer /healthz")
        assert api.poll() is None, log.read_text()
        yield base_url, settings
    finally:
        stop(api)


def _answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz").status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_readyz_and_jobs_wait_for_the_model_until_prepare_converted_it(
    unprepared_api: tuple[str, Settings], auth_headers: dict[str, str]
) -> None:
    base_url, settings = unprepared_api
    job = {"prompt": "Hello", "max_tokens": 4}

    not_ready = httpx.get(f"{base_url}/readyz")
    assert not_ready.status_code == 503 and not_ready.json()["model"] == "error: model not prepared"
    refused = httpx.post(f"{base_url}/v1/jobs", json=job, headers=auth_headers)
    assert refused.status_code == 503 and "not prepared" in refused.json()["error"]["message"], refused.text
    assert refused.headers["Retry-After"]

    prepare = subprocess.run([sys.executable, "-m", "cli.main", "prepare"], env=settings_env(settings),
                             capture_output=True, text=True, timeout=600)
    assert prepare.returncode == 0, prepare.stderr
    assert (settings.cache_dir / "smollm2-135m-instruct" / "config.json").is_file()

    ready = httpx.get(f"{base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["model"] == "ok", ready.text
    assert httpx.post(f"{base_url}/v1/jobs", json=job, headers=auth_headers).status_code == 202
