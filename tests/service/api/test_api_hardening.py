"""What one tenant sends cannot reach the engine or the store in a shape that breaks them for everyone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.prompts import prompt_model
from api.schemas import JobCreate
from core.prompts import load_prompt_model
from core.sampling_fields import SAMPLING_FIELDS
from core.settings import Settings
from engine.sampling_params import SamplingParams

NUL = "\u0000"


def _model_id(client: TestClient, headers: dict[str, str]) -> str:
    return client.get("/v1/models", headers=headers).json()["data"][0]["id"]


# --- model-aware validation -------------------------------------------------------------------------------------


def test_vocab_size_comes_from_the_model_config(api_model_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(api_model_dir, tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 128, "vocab_size": 64}))
    model = load_prompt_model(str(tmp_path / "model"))
    assert model.vocab_size == 64
    model.check_token_ids([0, 63], "stop_token_ids")
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 64 is outside the model's vocabulary \[0, 64\)"):
        model.check_token_ids([0, 64], "stop_token_ids")


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "the fox", "max_tokens": 10**9}, "max_tokens"),  # the prompt fits: asking too much is the fault
    ({"prompt_token_ids": [5] * 100, "max_tokens": 29}, "max_tokens"),
    ({"prompt_token_ids": [5] * 128, "max_tokens": 1}, "prompt_token_ids"),  # no room left for one token
    ({"prompt": "fox " * 200, "max_tokens": 1}, "prompt"),
])
def test_past_the_context_the_field_to_blame_is_named(
    client: TestClient, auth_headers: dict[str, str], body: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/jobs", json=body, headers=auth_headers)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field and "context of 128 tokens" in response.json()["error"]["message"]
    batch = client.post("/v1/jobs/batch", json={"jobs": [{"prompt": "Hi"}, body]}, headers=auth_headers)
    assert batch.status_code == 422 and batch.json()["error"]["field"] == f"jobs.1.{field}"


def test_the_reported_stop_token_attack_is_422_naming_stop_token_ids(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    body = {"prompt": "Hi", "max_tokens": 4, "stop_token_ids": [1000000000], "min_tokens": 1}
    response = client.post("/v1/jobs", json=body, headers=auth_headers)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "stop_token_ids"
    assert "1000000000" in response.json()["error"]["message"]


def test_a_stop_token_id_equal_to_the_vocab_size_is_refused_and_one_below_accepted(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    vocab_size = prompt_model().vocab_size
    refused = client.post("/v1/jobs", json={"prompt": "Hi", "stop_token_ids": [vocab_size]}, headers=auth_headers)
    accepted = client.post("/v1/jobs", json={"prompt": "Hi", "stop_token_ids": [vocab_size - 1]},
                           headers=auth_headers)
    assert (refused.status_code, accepted.status_code) == (422, 202)


def test_a_batch_names_the_job_whose_stop_token_id_is_out_of_range(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    jobs = [{"prompt": "Hi"}, {"prompt": "Hi", "stop_token_ids": [10**9]}]
    response = client.post("/v1/jobs/batch", json={"jobs": jobs}, headers=auth_headers)
    assert response.status_code == 422 and response.json()["error"]["field"] == "jobs.1.stop_token_ids"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_refuse_out_of_vocabulary_stop_ids_in_openai_shape(
    client: TestClient, auth_headers: dict[str, str], path: str
) -> None:
    prompt: dict[str, Any] = {"prompt": "Hi"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Hi"}]}
    body = {"model": _model_id(client, auth_headers), **prompt, "max_tokens": 4, "stop_token_ids": [10**9]}
    response = client.post(path, json=body, headers=auth_headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop_token_ids" and error["type"] == "invalid_request_error"


def test_a_temperature_too_small_to_divide_by_is_accepted_as_greedy(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    # vLLM treats temperatures below its epsilon as greedy; the engine does the same, so the API accepts them
    response = client.post("/v1/jobs", json={"prompt": "Hi", "max_tokens": 4, "temperature": 1e-40},
                           headers=auth_headers)
    assert response.status_code == 202 and response.json()["params"]["temperature"] == 1e-40


API_EXTREMES: list[dict[str, Any]] = [
    {"temperature": 0.0, "top_p": 5e-324, "top_k": 1, "min_p": 1.0, "seed": -(2**63), "repetition_penalty": 0.01,
     "presence_penalty": -2.0, "frequency_penalty": -2.0, "logprobs": 0, "length_penalty": -10.0},
    {"temperature": 10.0, "top_p": 1.0, "top_k": 100_000, "min_p": 0.0, "seed": 2**63 - 1,
     "repetition_penalty": 10.0, "presence_penalty": 2.0, "frequency_penalty": 2.0, "logprobs": 20, "n": 16,
     "max_tokens": SAMPLING_FIELDS["max_tokens"].service.high, "min_tokens": SAMPLING_FIELDS["min_tokens"].service.high,
     "stop_token_ids": [0]},
    {"temperature": 1e-40, "beam_width": 16, "length_penalty": 10.0},
]


@pytest.mark.parametrize("extremes", API_EXTREMES)
def test_every_value_the_api_accepts_the_engine_accepts(extremes: dict[str, Any]) -> None:
    params = JobCreate(prompt="Hi", **extremes).sampling_params()
    SamplingParams(**params)  # raises ValueError naming the argument the engine refuses


def test_a_repetition_penalty_the_engine_refuses_is_422(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/v1/jobs", json={"prompt": "Hi", "repetition_penalty": 1e-300}, headers=auth_headers)
    assert response.status_code == 422 and response.json()["error"]["field"] == "repetition_penalty"


# --- NUL characters and oversized bodies --------------------------------------------------------------------------

def test_a_nul_character_in_an_openai_prompt_is_400_naming_prompt(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    body = {"model": _model_id(client, auth_headers), "prompt": f"Hi{NUL}", "max_tokens": 2}
    response = client.post("/v1/completions", json=body, headers=auth_headers)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_token_ids_that_decode_to_nul_are_accepted_and_read_back_as_replacement_characters(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    # a byte-level tokenizer has a token for byte 0 (a model may sample it too); the ids are the prompt (the engine
    # gets them), the text is kept for reading back, where PostgreSQL cannot hold NUL
    tokenizer = prompt_model().tokenizer
    ids = tokenizer.encode("fox").ids + [tokenizer.token_to_id("\u0100")]  # ByteLevel's character for byte 0
    assert tokenizer.decode(ids) == f"fox{NUL}"
    response = client.post("/v1/jobs", json={"prompt_token_ids": ids, "max_tokens": 2}, headers=auth_headers)
    assert response.status_code == 202, response.text
    job = client.get(f"/v1/jobs/{response.json()['id']}", headers=auth_headers).json()
    assert job["prompt"] == "fox\ufffd"


def test_a_nul_character_in_a_job_id_is_404(client: TestClient, auth_headers: dict[str, str]) -> None:
    assert client.get("/v1/jobs/job_%00", headers=auth_headers).status_code == 404


def test_an_oversized_chunked_body_without_content_length_is_413(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(service_settings.max_body_bytes // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    headers = {**auth_headers, "Content-Type": "application/json"}
    response = client.post("/v1/jobs", content=chunks(), headers=headers)
    assert "content-length" not in response.request.headers
    assert response.status_code == 413 and response.json()["error"]["field"] == "body"


def test_an_oversized_body_is_413_in_openais_error_shape_too(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    body = {"model": "m", "prompt": "x" * (service_settings.max_body_bytes + 1)}
    response = client.post("/v1/completions", json=body, headers=auth_headers)
    assert response.status_code == 413
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"], error["field"]) == ("invalid_request_error", "body", None,
                                                                              "body")


# --- what tenants and unauthenticated callers are shown ---------------------------------------------------------


def test_jobs_do_not_show_the_worker_id(client: TestClient, auth_headers: dict[str, str]) -> None:
    job = client.post("/v1/jobs", json={"prompt": "Hi"}, headers=auth_headers).json()
    read_back = client.get(f"/v1/jobs/{job['id']}", headers=auth_headers).json()
    assert "worker_id" not in job and "worker_id" not in read_back


def test_home_in_path_settings_is_expanded() -> None:
    settings = Settings(data_dir="~/pagedserve-data", cache_dir="~/pagedserve-cache")
    assert settings.data_dir == Path.home() / "pagedserve-data"
    assert settings.cache_dir == Path.home() / "pagedserve-cache"
