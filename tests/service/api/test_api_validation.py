"""Every bad input is refused with a 4xx whose message names the field."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from core.prompts import load_prompt_model
from core.settings import Settings, configure
from core.webhook_urls import check_webhook_url

BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "priority": 10**6}, "priority"),
    ({"prompt": "x", "metadata": {"nested": {"a": 1}}}, "metadata"),
    ({"prompt": "x", "colour": "blue"}, "colour"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt, prompt_token_ids or messages"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt, prompt_token_ids or messages"),
    ({"prompt": "x", "prompt_token_ids": [1, 2]}, "prompt, prompt_token_ids or messages"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 10**9]}, "prompt_token_ids: token id 1000000000"),
    ({"prompt_token_ids": [-1]}, "prompt_token_ids: token id -1"),
    ({"prompt_token_ids": [1] * 500, "max_tokens": 64}, "prompt_token_ids: 500 prompt tokens"),
    ({"messages": [{"role": "wizard", "content": "y"}]}, "messages.0.role"),
    ({"prompt": "fox " * 100, "max_tokens": 64}, "prompt"),
    ({"prompt": "x", "webhook_url": "ftp://example.com/hook"}, "webhook_url"),
    # PostgreSQL text cannot hold NUL: refused on every store, not a 500 on one of them
    ({"prompt": "Hi\u0000there"}, "prompt: Value error, must not contain the NUL character"),
    ({"messages": [{"role": "user", "content": "Hi\u0000"}]}, "messages.0.content: Value error, must not contain"),
    ({"prompt": "Hi", "stop": ["a\u0000"]}, "stop.0: Value error, must not contain the NUL"),
    ({"prompt": "Hi", "metadata": {"note": "x\u0000"}}, "metadata.note"),
    ({"prompt": "Hi", "metadata": {"k\u0000": "x"}}, "metadata"),
    ({"prompt": "Hi", "webhook_url": "http://127.0.0.1/\u0000"}, "webhook_url: Value error, must not contain"),
    # structured outputs: compiled when the job is created, each kind named
    ({"prompt": "x", "structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex cannot be used"),
    ({"prompt": "x", "structured_outputs": {"json": "[" * 5000}}, "structured_outputs.json: Value error, is nested"),
    ({"prompt": "x", "structured_outputs": {"json": {"type": "strnig"}}}, "structured_outputs.json"),
    ({"prompt": "x", "structured_outputs": {"json": "{not json"}}, "structured_outputs.json: Value error, is not"),
    ({"prompt": "x", "structured_outputs": {"json": {"k\u0000": 1}}}, "structured_outputs.json: Value error, must"),
    ({"prompt": "x", "structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"prompt": "x", "structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice.1"),
    ({"prompt": "x", "structured_outputs": {}}, "structured_outputs: Value error, structured_outputs must set exactly"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"prompt": "x", "structured_outputs": {"json_object": False}}, "exactly one of"),
    ({"prompt": "x", "structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"prompt": "x", "structured_outputs": "a+"}, "structured_outputs"),
    ({"prompt": "x", "beam_width": 2, "structured_outputs": {"regex": "a"}}, "cannot be combined with beam search"),
    ({"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"prompt": "x", "logit_bias": {"fox": 1}}, "logit_bias.fox"),
    ({"prompt": "x", "logit_bias": {"1000000000": 1}}, "logit_bias: token id 1000000000"),
    ({"prompt": "x", "allowed_token_ids": [1, 10**9]}, "allowed_token_ids: token id 1000000000"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": ["dog", "  "]}, "bad_words"),
    ({"prompt": "x", "metadata": {"openai_endpoint": "/v1/responses"}}, "metadata: Value error, keys beginning"),
    ({"prompt": "x", "bad_words": ["x" * 257]}, "bad_words"),
    ({"prompt": "x", "bad_words": ["x"] * 65}, "bad_words"),
    ({"prompt": "x", "beam_width": 2, "logit_bias": {"5": 1}}, "logit_bias cannot be combined with beam search"),
    ({"prompt": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs shape how the chat template renders"),
    ({"prompt": "x", "add_generation_prompt": False}, "give them with messages"),
    ({"messages": [{"role": "user", "content": "y"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "y"}], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs.tools"),
    ({"messages": [{"role": "user", "content": "y"}], "chat_template_kwargs": {"a": "\u0000"}},
     "chat_template_kwargs: Value error, must not contain the NUL"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES, ids=[field for _, field in BAD_BODIES])
def test_bad_job_body_is_422_naming_the_field(
    client: TestClient, auth_headers: dict[str, str], body: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/jobs", json=body, headers=auth_headers)
    assert response.status_code == 422, response.text
    assert field in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "x", "max_tokens": 16, "min_tokens": 17}, "min_tokens"),
    ({"prompt": "x", "min_tokens": 17}, "min_tokens"),  # against max_tokens' default
    ({"prompt": "x", "n": 2, "beam_width": 2}, "beam_width"),
    ({"prompt": "x", "beam_width": 2, "allowed_token_ids": [5]}, "allowed_token_ids"),
    # min_tokens holds back EOS (<|im_end|>, id 1 of this tokenizer) and stop_token_ids: nothing else is samplable
    ({"prompt": "x", "min_tokens": 2, "allowed_token_ids": [1]}, "allowed_token_ids"),
    ({"prompt": "x", "min_tokens": 1, "allowed_token_ids": [1, 7], "stop_token_ids": [7]}, "allowed_token_ids"),
])
def test_a_check_across_fields_names_the_field(
    client: TestClient, auth_headers: dict[str, str], body: dict[str, Any], field: str
) -> None:
    response = client.post("/v1/jobs", json=body, headers=auth_headers)
    assert response.status_code == 422 and response.json()["error"]["field"] == field, response.text


@pytest.mark.parametrize("body", [
    {"prompt": "x", "min_tokens": 2, "allowed_token_ids": [1], "ignore_eos": True},
    {"prompt": "x", "min_tokens": 2, "allowed_token_ids": [1, 7]},
    {"prompt": "x", "allowed_token_ids": [1]},
])
def test_allowed_stop_tokens_are_accepted_where_something_stays_samplable(
    client: TestClient, auth_headers: dict[str, str], body: dict[str, Any]
) -> None:
    assert client.post("/v1/jobs", json=body, headers=auth_headers).status_code == 202


def test_the_api_knows_the_eos_tokens_the_engine_holds_back(smollm2_dir: Path, tiny_model_dir: Path) -> None:
    from engine.model_files import load_tokenizer
    from engine.models.loader import eos_token_ids, load_config

    for folder in (smollm2_dir, tiny_model_dir):
        engine_ids = eos_token_ids(folder, load_config(folder), load_tokenizer(str(folder)))
        assert engine_ids and load_prompt_model(str(folder)).eos_token_ids == engine_ids


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(client: TestClient, auth_headers: dict[str, str], literal: str) -> None:
    body = f'{{"prompt": "x", "temperature": {literal}}}'
    response = client.post("/v1/jobs", content=body, headers={**auth_headers, "Content-Type": "application/json"})
    assert response.status_code == 422 and "temperature" in response.json()["error"]["message"]


def test_invalid_json_is_422(client: TestClient, auth_headers: dict[str, str]) -> None:
    headers = {**auth_headers, "Content-Type": "application/json"}
    response = client.post("/v1/jobs", content=b'{"prompt": "x",', headers=headers)
    assert response.status_code == 422 and "JSON" in response.json()["error"]["message"]
    assert response.json()["error"]["field"] == "body"  # not the character where parsing stopped


LONE_SURROGATES = [  # JSON may spell one (\\ud800); no store nor response can hold it
    ('{"prompt": "a\\ud800b"}', "prompt"),
    ('{"prompt": "x", "stop": ["\\udfff"]}', "stop.0"),
    ('{"prompt": "x", "metadata": {"k": "\\ud800"}}', "metadata.k"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content"),
    ('{"prompt": "x", "structured_outputs": {"choice": ["\\ud800"]}}', "structured_outputs.choice.0"),
]


@pytest.mark.parametrize(("body", "field"), LONE_SURROGATES, ids=[field for _, field in LONE_SURROGATES])
def test_a_lone_surrogate_is_422_naming_the_field_and_stores_nothing(
    client: TestClient, new_auth_headers: Callable[[str], dict[str, str]], body: str, field: str
) -> None:
    headers = {**new_auth_headers("surrogates"), "Content-Type": "application/json"}
    response = client.post("/v1/jobs", content=body.encode(), headers=headers)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field and ("surrogate" in response.text or "unicode" in response.text)
    assert client.get("/v1/jobs", headers=headers).json()["data"] == []
    openai = client.post("/v1/completions", content=b'{"prompt": "a\\ud800", "max_tokens": 1}', headers=headers)
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "prompt"


def test_fastapis_own_errors_come_in_the_documented_shape(client: TestClient, auth_headers: dict[str, str]) -> None:
    unauthorized = client.get("/v1/jobs")
    assert unauthorized.status_code == 401 and unauthorized.headers["WWW-Authenticate"] == "Bearer"
    assert unauthorized.json()["error"] == {"message": unauthorized.json()["detail"], "field": None, "status": 401,
                                            "type": "authentication_error", "param": None, "code": None}
    not_allowed = client.delete("/v1/jobs")
    assert not_allowed.status_code == 405 and not_allowed.json()["error"]["status"] == 405
    # an OpenAI client reads any error of this server: a route it does not serve, a native route's refusal
    unknown = client.post("/v1/embeddings", json={"input": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    refused = client.post("/v1/jobs", json={"prompt": "x", "top_p": 0}, headers=auth_headers)
    assert refused.json()["error"]["param"] == "top_p" and refused.json()["error"]["type"] == "invalid_request_error"


def test_invalid_utf8_is_422(client: TestClient, auth_headers: dict[str, str]) -> None:
    headers = {**auth_headers, "Content-Type": "application/json"}
    response = client.post("/v1/jobs", content=b'{"prompt": "\xff\xfe"}', headers=headers)
    assert 400 <= response.status_code < 500


def test_oversize_body_is_413(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/v1/jobs", json={"prompt": "x" * 100_000}, headers=auth_headers)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]


def test_bad_list_parameters_are_422(client: TestClient, auth_headers: dict[str, str]) -> None:
    assert client.get("/v1/jobs", params={"status": "sleeping"}, headers=auth_headers).status_code == 422
    assert client.get("/v1/jobs", params={"limit": 0}, headers=auth_headers).status_code == 422
    crafted = [["0001-01-01T00:00:00+01:00", "job_" + "0" * 32], ["0001-01-01T00:00:00", "job_" + "0" * 32],
               ["2026-01-01T00:00:00+00:00", "job_\ud800"], ["2026-01-01T00:00:00+00:00", 7]]
    for cursor in ["not-a-cursor", *(base64.urlsafe_b64encode(json.dumps(c).encode()).decode() for c in crafted)]:
        response = client.get("/v1/jobs", params={"cursor": cursor}, headers=auth_headers)
        assert response.status_code == 422 and response.json()["error"]["field"] == "cursor", cursor


def test_unknown_job_is_404(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.get("/v1/jobs/job_doesnotexist", headers=auth_headers)
    assert response.status_code == 404 and response.json()["error"]["field"] == "job_id"


PRIVATE_URLS = ["http://127.0.0.1/hook", "http://10.1.2.3/hook", "http://[::1]/hook", "http://localhost/"]


@pytest.mark.parametrize("url", PRIVATE_URLS)
def test_private_webhook_targets_are_refused_unless_allowed(url: str) -> None:
    with pytest.raises(ValueError, match="non-public"):
        check_webhook_url(url, allow_private=False)
    check_webhook_url(url, allow_private=True)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/", "http://127.0.0.1:0/", "http://127.0.0.1:port/"])
def test_a_webhook_port_out_of_range_is_named_as_the_port(url: str) -> None:
    with pytest.raises(ValueError, match="webhook_url port must be a number in 1-65535"):
        check_webhook_url(url, allow_private=True)


def test_more_sequences_than_a_step_runs_are_refused_before_a_job_exists(
    service_settings: Settings, new_auth_headers: Callable[[str], dict[str, str]]
) -> None:
    headers = new_auth_headers("wide")
    try:
        with TestClient(create_app(service_settings.model_copy(update={"max_num_seqs": 4}))) as client:
            for field, value in (("n", 5), ("beam_width", 5)):
                response = client.post("/v1/jobs", json={"prompt": "x", field: value}, headers=headers)
                assert response.status_code == 422 and response.json()["error"]["field"] == field
            assert client.post("/v1/jobs", json={"prompt": "x", "n": 4}, headers=headers).status_code == 202
            chat = {"messages": [{"role": "user", "content": "x"}], "n": 5, "stream": True, "max_tokens": 2}
            streamed = client.post("/v1/chat/completions", json=chat, headers=headers)  # refused before any chunk
            assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "n"
            assert len(client.get("/v1/jobs", headers=headers).json()["data"]) == 1
    finally:
        configure(service_settings)


def test_n_may_reach_max_num_seqs_above_sixteen_as_samplers_ask(
    client: TestClient, auth_headers: dict[str, str], service_settings: Settings
) -> None:
    wide = client.post("/v1/jobs", json={"prompt": "x", "n": service_settings.max_num_seqs}, headers=auth_headers)
    assert wide.status_code == 202 and wide.json()["params"]["n"] == service_settings.max_num_seqs > 16
    stops = client.post("/v1/jobs", json={"prompt": "x", "stop": [f"s{i}" for i in range(64)]}, headers=auth_headers)
    assert stops.status_code == 202, stops.text

