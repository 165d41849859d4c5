"""Running a job: claim, engine, token events, result, cancellation — with the real store, Redis and engine."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from api.app import create_app
from core import streams
from core.db import session_factory
from core.models import Job
from core.openai_responses import job_failure
from core.settings import Settings
from engine import SamplingParams
from tests.engine.hf_reference import hf_beam, hf_logprobs
from tests.service.procs import wait_until
from worker.engine_service import EngineService
from worker.runner import run_job


def _submit(service_settings: Settings, headers: dict[str, str], **body: object) -> str:
    response = TestClient(create_app(service_settings)).post("/v1/jobs", json=body, headers=headers)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _job(service_settings: Settings, headers: dict[str, str], job_id: str) -> dict:
    return TestClient(create_app(service_settings)).get(f"/v1/jobs/{job_id}", headers=headers).json()


def test_job_runs_to_success_and_streams_its_tokens(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    job_id = _submit(service_settings, auth_headers, prompt="Once upon a time", max_tokens=10, temperature=0.0)
    run_job(job_id, service, SamplingParams)
    job = _job(service_settings, auth_headers, job_id)
    assert job["status"] == "succeeded" and job["attempts"] == 1 and job["completion_tokens"] == 10
    assert job["started_at"] <= job["first_token_at"] <= job["finished_at"]
    entries = streams.redis_client().xrange(streams.events_key(job_id))
    tokens = [json.loads(fields["data"]) for _, fields in entries if fields["type"] == "token"]
    assert "".join(t["text"] for t in tokens) == job["text"]
    assert [i for t in tokens for i in t["token_ids"]] == job["choices"][0]["token_ids"]
    assert entries[-1][1]["type"] == "final"


def test_a_finished_job_is_not_run_again(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    job_id = _submit(service_settings, auth_headers, prompt="Again", max_tokens=2)
    run_job(job_id, service, SamplingParams)
    run_job(job_id, service, SamplingParams)
    assert _job(service_settings, auth_headers, job_id)["attempts"] == 1


def test_a_cancelled_queued_job_never_starts(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    client = TestClient(create_app(service_settings))
    job_id = _submit(service_settings, auth_headers, prompt="Never", max_tokens=2)
    client.post(f"/v1/jobs/{job_id}/cancel", headers=auth_headers)
    run_job(job_id, service, SamplingParams)
    job = _job(service_settings, auth_headers, job_id)
    assert job["status"] == "cancelled" and job["attempts"] == 0 and job["started_at"] is None


def test_cancelling_a_running_job_aborts_it_mid_generation_and_frees_its_blocks(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    client = TestClient(create_app(service_settings))
    generated_before = service.engine.stats().generation_tokens
    job_id = _submit(service_settings, auth_headers, prompt="Go on", max_tokens=400, ignore_eos=True)
    runner = threading.Thread(target=run_job, args=(job_id, service, SamplingParams))
    runner.start()
    wait_until(lambda: _job(service_settings, auth_headers, job_id)["first_token_at"] is not None, 60,
               "the job's first token")
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth_headers).json()["status"] == "cancelled"
    runner.join(timeout=60)
    assert not runner.is_alive()
    wait_until(lambda: service.engine.stats().kv_cache_usage == 0.0, 60, "the aborted request's blocks to be freed")
    # the engine stopped generating where the job was cancelled, rather than running it to its end
    assert service.engine.stats().generation_tokens - generated_before < 400
    # it keeps what it generated until then, as vLLM reports an aborted request: the tokens streamed, and maybe more
    job = _job(service_settings, auth_headers, job_id)
    assert job["status"] == "cancelled" and job["finished_at"] is not None
    (choice,) = job["choices"]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 400
    assert job["completion_tokens"] == len(choice["token_ids"]) and job["text"] == choice["text"]
    entries = streams.redis_client().xrange(streams.events_key(job_id))
    tokens = [json.loads(fields["data"]) for _, fields in entries if fields["type"] == "token"]
    streamed = [i for token in tokens for i in token["token_ids"]]
    assert streamed and choice["token_ids"][:len(streamed)] == streamed


def test_beam_search_job_returns_its_beams_best_first(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str], tiny_model_dir: Path
) -> None:
    job_id = _submit(service_settings, auth_headers, prompt="Once upon a time", max_tokens=6, beam_width=3,
                     temperature=0.0, ignore_eos=True)
    run_job(job_id, service, SamplingParams)
    job = _job(service_settings, auth_headers, job_id)
    assert job["status"] == "succeeded"
    beams = [c["token_ids"] for c in job["choices"]]
    assert len(beams) == 3 and all(len(beam) == 6 for beam in beams) and len(set(map(tuple, beams))) == 3
    # the oracle is transformers: its best beam comes first, and its log-probabilities order the rest
    prompt_ids = AutoTokenizer.from_pretrained(tiny_model_dir).encode("Once upon a time")
    assert beams[0] == hf_beam(tiny_model_dir, "Once upon a time", beam_width=3, max_tokens=6)
    scores = [hf_logprobs(tiny_model_dir, prompt_ids, beam).gather(1, torch.tensor(beam)[:, None]).sum().item()
              for beam in beams]
    assert scores == sorted(scores, reverse=True)


def test_beam_search_with_several_samples_is_refused(
    service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    response = TestClient(create_app(service_settings)).post(
        "/v1/jobs", json={"prompt": "x", "beam_width": 2, "n": 2}, headers=auth_headers
    )
    assert response.status_code == 422 and "beam" in response.text


def test_a_constraint_that_breaks_down_fails_its_job_as_the_clients_to_change(
    service: EngineService, service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    job_id = _submit(service_settings, auth_headers, prompt="Letters:", max_tokens=4,
                     structured_outputs={"regex": "[^\\s\\S]"})  # compiles, matches nothing
    run_job(job_id, service, SamplingParams)
    job = _job(service_settings, auth_headers, job_id)
    assert job["status"] == "failed" and job["error"].startswith(
        "refused: StructuredOutputError: structured_outputs.regex could not be followed")
    with session_factory()() as session:  # the OpenAI routes answer it with a 400, not a 500
        failure = job_failure(session.get(Job, job_id))
    assert failure is not None and failure.status_code == 400
