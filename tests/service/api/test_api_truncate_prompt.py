"""vLLM's truncate_prompt_tokens: a prompt longer than the context keeps only its last N tokens, which the job
keeps as the ids its engine runs (text, token-id and chat prompts alike)."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.prompts import prompt_model
from core.db import session_factory
from core.models import Job

LONG = " ".join(f"word{i}" for i in range(400))  # far past the test model's 128-token context


def _stored(job_id: str) -> Job:
    with session_factory()() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _submit(client: TestClient, headers: dict[str, str], **body: Any) -> Job:
    response = client.post("/v1/jobs", json={"max_tokens": 4, **body}, headers=headers)
    assert response.status_code == 202, response.text
    return _stored(response.json()["id"])


def test_a_text_prompt_keeps_its_last_tokens(client: TestClient, auth_headers: dict[str, str]) -> None:
    ids = prompt_model().tokenizer.encode(LONG).ids
    assert client.post("/v1/jobs", json={"prompt": LONG, "max_tokens": 4}, headers=auth_headers).status_code == 422
    job = _submit(client, auth_headers, prompt=LONG, truncate_prompt_tokens=20)
    assert job.prompt_token_ids == ids[-20:] and job.prompt_tokens == 20
    assert job.prompt == prompt_model().tokenizer.decode(ids[-20:], skip_special_tokens=False)
    short = _submit(client, auth_headers, prompt="a short one", truncate_prompt_tokens=100)  # nothing to cut
    assert short.prompt_token_ids == prompt_model().tokenizer.encode("a short one").ids


def test_minus_one_keeps_what_fits_beside_max_tokens(client: TestClient, auth_headers: dict[str, str]) -> None:
    model = prompt_model()
    job = _submit(client, auth_headers, prompt=LONG, truncate_prompt_tokens=-1, max_tokens=8)
    assert job.prompt_tokens == model.max_model_len - 8
    ids = [1 + i % 200 for i in range(300)]
    by_ids = _submit(client, auth_headers, prompt_token_ids=ids, truncate_prompt_tokens=-1)
    assert by_ids.prompt_token_ids == ids[-(model.max_model_len - 4):]


def test_a_chat_keeps_the_end_of_its_rendered_prompt(client: TestClient, auth_headers: dict[str, str]) -> None:
    messages = [{"role": "user", "content": LONG}]
    job = _submit(client, auth_headers, messages=messages, truncate_prompt_tokens=30)
    rendered = prompt_model().render_chat(messages)
    assert job.prompt_token_ids == prompt_model().tokenizer.encode(rendered).ids[-30:]


def test_the_openai_requests_pass_it_to_their_jobs() -> None:
    completion = CompletionRequest.model_validate({"prompt": LONG, "max_tokens": 2, "truncate_prompt_tokens": 9})
    assert completion.to_jobs()[0].truncate_prompt_tokens == 9
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "truncate_prompt_tokens": -1})
    assert chat.to_job().truncate_prompt_tokens == -1
    assert "truncate_prompt_tokens" not in completion.model_extra  # a field of its own, not an ignored one


def test_zero_is_no_number_of_tokens_to_keep(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/v1/jobs", json={"prompt": "x", "truncate_prompt_tokens": 0}, headers=auth_headers)
    assert response.status_code == 422 and response.json()["error"]["field"] == "truncate_prompt_tokens"


def test_a_truncated_chat_without_a_limit_may_fill_the_context_left_beside_what_it_keeps() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": LONG}], "truncate_prompt_tokens": 30})
    assert chat.to_job().max_tokens == prompt_model().max_model_len - 30
