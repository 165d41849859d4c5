"""Engine pressure through the worker: a burst larger than KV plus swap waits or swaps; what can never fit fails
clearly."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.db import session_factory
from core.models import Job
from core.openai_responses import job_failure
from core.settings import Settings
from engine import LLMEngine, SamplingParams
from tests.agreement import Sample, assert_agree_up_to_rounding
from worker.engine_service import EngineService
from worker.runner import run_job
from worker.token_stream import TokenPublisher

# The tiny Llama holds 512 bytes of fp32 KV per token: 12 device blocks and 8 swap blocks of 16 tokens.
KV_CACHE_MEMORY, SWAP_SPACE = "96KiB", "64KiB"


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """The store does not matter here: SQLite only."""
    return sqlite_url


@pytest.fixture(scope="module")
def small_service(service_model_dir: Path) -> Iterator[EngineService]:
    """An engine service whose KV cache and swap pool together hold 320 tokens."""
    engine = LLMEngine.from_kwargs(model=str(service_model_dir), dtype="float32", kv_cache_memory=KV_CACHE_MEMORY,
                                   swap_space=SWAP_SPACE, max_num_seqs=16, preemption_mode="swap",
                                   cpu_weight_packing="exact")  # the numerics of service_settings' unpressured run
    service = EngineService(engine, token_sink=TokenPublisher()).start()
    yield service
    service.stop()


def _run_all(settings: Settings, headers: dict[str, str], service: EngineService, bodies: list[dict]) -> list[dict]:
    client = TestClient(create_app(settings))
    job_ids = [client.post("/v1/jobs", json=body, headers=headers).json()["id"] for body in bodies]
    with ThreadPoolExecutor(max_workers=len(job_ids)) as pool:
        list(pool.map(lambda job_id: run_job(job_id, service, SamplingParams), job_ids))
    return [client.get(f"/v1/jobs/{job_id}", headers=headers).json() for job_id in job_ids]


def test_a_burst_larger_than_kv_and_swap_completes_with_the_texts_of_an_unpressured_run(
    small_service: EngineService, service: EngineService, service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    bodies = [{"prompt": f"Pressure {i}", "max_tokens": 60, "ignore_eos": True, "temperature": 1.0, "seed": i,
               "logprobs": 0} for i in range(12)]
    jobs = _run_all(service_settings, auth_headers, small_service, bodies)
    assert [job["status"] for job in jobs] == ["succeeded"] * 12
    assert all(job["completion_tokens"] == 60 for job in jobs)
    stats = small_service.engine.stats()
    assert stats.num_preemptions_swap > 0 and stats.num_blocks_swapped_in > 0
    unpressured = _run_all(service_settings, auth_headers, service, bodies)
    assert_agree_up_to_rounding(_samples(jobs), _samples(unpressured))


def _samples(jobs: list[dict]) -> list[Sample]:
    choices = [job["choices"][0] for job in jobs]
    return [(c["token_ids"], [step[str(token)] for step, token in zip(c["logprobs"], c["token_ids"])]) for c in choices]


def test_a_request_that_can_never_fit_fails_with_a_clear_error(
    small_service: EngineService, service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    bodies = [{"prompt": "Too long to ever fit", "max_tokens": 300}, {"prompt": "Fits", "max_tokens": 4}]
    never, fits = _run_all(service_settings, auth_headers, small_service, bodies)
    assert never["status"] == "failed" and "KV blocks but kv_cache_memory holds" in never["error"]
    assert fits["status"] == "succeeded"
    with session_factory()() as session:  # the client's to change: OpenAI routes answer it with a 400
        failures = [job_failure(session.get(Job, job["id"])) for job in (never, fits)]
    assert failures[0] is not None and failures[0].status_code == 400 and failures[1] is None
