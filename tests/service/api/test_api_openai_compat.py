"""vLLM's auxiliary routes and the OpenAI request checks that answer before any job runs (no worker needed)."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.prompts import prompt_model
from core.settings import Settings, configure

ALIASES = ["tiny", "tiny-chat"]


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """SQLite only: these routes do not depend on the store."""
    return sqlite_url


@pytest.fixture(scope="module")
def service_settings(service_settings: Settings) -> Iterator[Settings]:
    """The module's settings with two served model names; a request wrongly accepted times out (no worker) fast."""
    aliased = service_settings.model_copy(update={"served_model_name": ALIASES, "openai_timeout_s": 2.0})
    configure(aliased)
    yield aliased
    configure(service_settings)


def _error(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_health_is_200_with_an_empty_body(client: TestClient) -> None:
    response = client.get("/health")
    assert response.status_code == 200 and response.content == b""


def test_version_is_the_installed_package_version(client: TestClient) -> None:
    assert client.get("/version").json() == {"version": version("pagedserve")}


def test_models_lists_every_served_name_with_its_context_length(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    cards = client.get("/v1/models", headers=auth_headers).json()["data"]
    assert [c["id"] for c in cards] == ALIASES
    assert all(c["max_model_len"] == 128 and c["owned_by"] == "pagedserve" for c in cards)


def test_an_unknown_model_is_openais_model_not_found(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "fox"}, headers=auth_headers)
    error = response.json()["error"]
    assert response.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert all(alias in error["message"] for alias in ALIASES)


@pytest.mark.parametrize(("extra", "param"), [
    ({"suffix": "the end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], [10**6]]}, "prompt.1"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["fox"] * 65}, "prompt"),
])
def test_unsupported_or_invalid_completion_input_is_400_naming_it(
    client: TestClient, auth_headers: dict[str, str], extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "prompt": "fox", **extra}
    error = _error(client.post("/v1/completions", json=body, headers=auth_headers))
    assert error["param"] == param and param.split(".")[0] in error["message"] + error["param"]


def test_token_ids_past_the_vocabulary_are_refused_naming_the_id(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    vocab_size = prompt_model().vocab_size
    body = {"model": "tiny", "prompt": [5, vocab_size]}
    error = _error(client.post("/v1/completions", json=body, headers=auth_headers))
    assert f"token id {vocab_size} " in error["message"] and f"[0, {vocab_size})" in error["message"]


def test_tokenize_and_detokenize_round_trip(client: TestClient, auth_headers: dict[str, str]) -> None:
    body = {"model": "tiny-chat", "prompt": "the lazy dog", "return_token_strs": True}
    tokens = client.post("/tokenize", json=body, headers=auth_headers).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 128
    text = client.post("/detokenize", json={"tokens": tokens["tokens"]}, headers=auth_headers).json()
    assert text == {"prompt": "the lazy dog"}


def test_tokenize_renders_messages_through_the_chat_template(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    messages = [{"role": "user", "content": "the fox"}]
    with_prompt = client.post("/tokenize", json={"messages": messages}, headers=auth_headers).json()
    without = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False},
                          headers=auth_headers).json()
    def text(tokens: list[int]) -> str:  # this tokenizer has no newline token: the template's newlines drop out
        return client.post("/detokenize", json={"tokens": tokens}, headers=auth_headers).json()["prompt"]

    assert text(with_prompt["tokens"]) == "<|im_start|>userthe fox<|im_end|><|im_start|>assistant"
    assert text(without["tokens"]) == "<|im_start|>userthe fox<|im_end|>"


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "body"),
    ("/tokenize", {"prompt": "x", "colour": "blue"}, "colour"),
    ("/detokenize", {"tokens": [1, 300]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_tokenizer_requests_are_400_naming_the_field(
    client: TestClient, auth_headers: dict[str, str], route: str, body: dict[str, Any], param: str
) -> None:
    assert _error(client.post(route, json=body, headers=auth_headers))["param"] == param


def test_tokenize_needs_an_api_key(client: TestClient) -> None:
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401


def test_tokenize_for_an_unknown_model_is_404(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}, headers=auth_headers)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
