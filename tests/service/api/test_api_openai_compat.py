"""vLLM's auxiliary routes and the OpenAI request checks that answer before any job runs (no worker needed)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.app import create_app
from api.batch_input import build_line
from api.openai_schemas import ChatCompletionRequest, CompletionRequest, ignored_fields
from api.prompts import prompt_model
from core.models import ApiKey, Job, JobStatus
from core.openai_responses import COMPLETIONS, answer_model, chat_body, completion_body
from core.prompts import ChatTemplateOptions, PromptFieldError
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


@pytest.mark.parametrize(("method", "path"), [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")])
def test_health_and_ping_are_200_with_an_empty_body(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, path)
    assert response.status_code == 200 and response.content == b""


def test_version_is_the_installed_package_version(client: TestClient) -> None:
    assert client.get("/version").json() == {"version": version("pagedserve")}


def test_models_lists_every_served_name_with_its_context_length(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    cards = client.get("/v1/models", headers=auth_headers).json()["data"]
    assert [c["id"] for c in cards] == ALIASES
    assert all(c["max_model_len"] == 128 and c["owned_by"] == "pagedserve" for c in cards)
    # the openai client's models.retrieve: each served name's card, OpenAI's 404 for any other
    assert [client.get(f"/v1/models/{name}", headers=auth_headers).json() for name in ALIASES] == cards
    unknown = client.get("/v1/models/org/gpt-4", headers=auth_headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_an_unknown_model_is_openais_model_not_found(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "fox"}, headers=auth_headers)
    error = response.json()["error"]
    assert response.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert all(alias in error["message"] for alias in ALIASES)


@pytest.mark.parametrize(("extra", "param"), [
    ({"suffix": "the end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[5], []]}, "prompt"),
    ({"prompt": [[1, 2], [10**6]]}, "prompt.1"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["fox"] * 65}, "prompt"),
    ({"prompt": None}, "prompt"),  # a required field sent as null is missing
    ({"prompt": [5] * 200}, "prompt"),  # token ids past the 128-token context: the request's field, not the job's
    ({"prompt": ["fox", "fox " * 200]}, "prompt.1"),
    ({"prompt": [[5], [5] * 200]}, "prompt.1"),
    ({"prompt": ["fox", "fox"], "max_tokens": 10**6}, "max_tokens"),  # the prompts fit; max_tokens is too large
    ({"logit_bias": {"fox": 1}}, "logit_bias.fox.[key]"),
    ({"logit_bias": {"5": "high"}}, "logit_bias.5"),
    ({"logit_bias": {"1000000": 5}}, "logit_bias"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"bad_words": ["fox", " "]}, "bad_words"),
    # fields that would change the answer are refused, not ignored
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    # grammars compile with the job, off the event loop; their errors still name the request's field
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"use_beam_search": True, "n": 2}, "use_beam_search"),
    ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),  # a check across fields names the field, not the body
])
def test_unsupported_or_invalid_completion_input_is_400_naming_it(
    client: TestClient, auth_headers: dict[str, str], extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "prompt": "fox", **extra}
    error = _error(client.post("/v1/completions", json=body, headers=auth_headers))
    assert error["param"] == param and param.split(".")[0] in error["message"] + error["param"]
    assert "jobs." not in error["message"] and "prompt_token_ids" not in error["message"]


def _every_optional_field_null(schema: type[CompletionRequest] | type[ChatCompletionRequest]) -> dict[str, None]:
    return {name: None for name, field in schema.model_fields.items() if not field.is_required()}


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as vLLM and OpenAI refuse it
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ({"user": "a\u0000b"}, "user"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens"),  # past the 128-token context
])
def test_invalid_chat_input_is_400_naming_the_field_the_client_sent(
    client: TestClient, auth_headers: dict[str, str], extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "fox"}], **extra}
    error = _error(client.post("/v1/chat/completions", json=body, headers=auth_headers))
    assert error["param"] == param and param in error["message"]


TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "the fox"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "jump", "arguments": '{"over": "dog"}'}}]},
    {"role": "tool", "content": "the lazy dog", "tool_call_id": "call_1"},
]


def test_a_tool_using_conversations_history_is_accepted_and_kept_for_the_template(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    job = ChatCompletionRequest(model="tiny", messages=TOOL_HISTORY, max_tokens=2).to_job()
    assert job.messages is not None and [m.role for m in job.messages] == ["user", "assistant", "tool"]
    assert job.messages[1].content == "" and job.messages[1].tool_calls is not None
    assert job.messages[1].tool_calls[0].function.name == "jump" and job.messages[2].tool_call_id == "call_1"
    rendered = client.post("/tokenize", json={"messages": TOOL_HISTORY}, headers=auth_headers)
    assert rendered.status_code == 200, rendered.text
    text = client.post("/detokenize", json={"tokens": rendered.json()["tokens"]}, headers=auth_headers).json()
    assert "<|im_start|>tool\nthe lazy dog<|im_end|>" in text["prompt"]
    stored = client.post("/v1/jobs", json={"messages": job.model_dump(exclude_none=True)["messages"], "max_tokens": 2},
                         headers=auth_headers)
    assert stored.status_code == 202, stored.text
    shown = client.get(f"/v1/jobs/{stored.json()['id']}", headers=auth_headers).json()["messages"]
    assert shown[1]["tool_calls"][0]["id"] == "call_1" and "tool_calls" not in shown[0]  # unset fields stay out


@pytest.mark.parametrize(("route", "message", "param"), [
    ("/v1/chat/completions", {"role": "tool", "content": None, "tool_call_id": "c"}, "messages.0"),
    ("/v1/chat/completions", {"role": "user", "content": None}, "messages.0"),
    ("/v1/jobs", {"role": "user", "content": "x", "tool_call_id": "c"}, "messages.0"),
    ("/v1/jobs", {"role": "tool", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "messages.0"),
])
def test_misplaced_tool_fields_are_refused_naming_the_message(
    client: TestClient, auth_headers: dict[str, str], route: str, message: dict[str, Any], param: str
) -> None:
    response = client.post(route, json={"model": "tiny", "messages": [message]} if route != "/v1/jobs" else
                           {"messages": [message]}, headers=auth_headers)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert (error.get("param") or error.get("field")) == param


@pytest.mark.parametrize(("schema", "given"), [
    (CompletionRequest, {"model": "tiny", "prompt": "fox"}),
    (ChatCompletionRequest, {"model": "tiny", "messages": [{"role": "user", "content": "fox", "name": None}]}),
])
def test_a_null_optional_field_is_its_default_as_openais_nullable_fields_are(
    schema: type[CompletionRequest] | type[ChatCompletionRequest], given: dict[str, Any]
) -> None:
    def jobs(body: dict[str, Any]) -> list[Any]:
        request = schema.model_validate(body)
        return request.to_jobs() if isinstance(request, CompletionRequest) else [request.to_job()]

    assert jobs({**_every_optional_field_null(schema), **given}) == jobs(given)
    options = schema.model_validate({**given, "stream": True, "stream_options": {"include_usage": None}})
    assert options.stream_options is not None and options.stream_options.include_usage is False


def test_without_a_model_the_served_model_answers(client: TestClient, auth_headers: dict[str, str]) -> None:
    # vLLM's model field is optional; OpenAI's own clients always send one
    (named,) = CompletionRequest(model="tiny", prompt="fox").to_jobs()
    unnamed_metadata = {k: v for k, v in (named.metadata or {}).items() if k != "openai_model"}
    assert CompletionRequest(prompt="fox").to_jobs() == [named.model_copy(update={"metadata": unnamed_metadata})]
    error = _error(client.post("/v1/completions", json={"prompt": "fox", "suffix": "!"}, headers=auth_headers))
    assert error["param"] == "suffix"  # reached the request's own checks, past the model


def test_a_chat_without_max_tokens_may_fill_a_context_past_32k_tokens(
    service_settings: Settings, api_model_dir: Path, tmp_path: Path
) -> None:
    long_model = tmp_path / "long-context"
    shutil.copytree(api_model_dir, long_model)
    (long_model / "config.json").write_text(json.dumps({"max_position_embeddings": 131_072}))
    configure(service_settings.model_copy(update={"model": str(long_model), "max_model_len": None}))
    try:
        messages = [{"role": "user", "content": "the quick brown fox"}]
        rest_of_context = ChatCompletionRequest(messages=messages).to_job().max_tokens
        explicit = ChatCompletionRequest(messages=messages, max_tokens=100_000).to_job().max_tokens
    finally:
        configure(service_settings)
    assert 131_072 - 64 < rest_of_context < 131_072 and explicit == 100_000


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strnig"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),  # two constraints
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_an_unusable_output_constraint_is_400_naming_the_field_sent(
    client: TestClient, auth_headers: dict[str, str], route: str, extra: dict[str, Any], param: str
) -> None:
    prompt = {"prompt": "fox"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "fox"}]}
    error = _error(client.post(route, json={"model": "tiny", "max_tokens": 4, **prompt, **extra},
                               headers=auth_headers))
    assert error["param"] == param and param in error["message"], error
    assert "jobs." not in error["message"]


@pytest.mark.parametrize(("extra", "stored"), [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}}},
     {"json": {"type": "integer"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
     {"regex": "[a-z]+", "disable_any_whitespace": True}),
])
def test_each_way_to_ask_for_structured_output_becomes_the_jobs_constraint(
    extra: dict[str, Any], stored: dict[str, Any] | None
) -> None:
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "fox"}], max_tokens=4, **extra)
    assert body.to_job().sampling_params()["structured_outputs"] == stored


def test_logit_bias_takes_token_ids_as_text_and_is_clamped_to_openais_range_as_vllm_does() -> None:
    body = CompletionRequest(model="tiny", prompt="fox", logit_bias={"5": 250.0, "7": -1e9, "9": 0.5},
                             allowed_token_ids=[5, 7])
    params = body.to_job().sampling_params()
    assert params["logit_bias"] == {5: 100.0, 7: -100.0, 9: 0.5} and params["allowed_token_ids"] == [5, 7]


def test_bad_words_reach_the_job_as_vllms_sampling_field() -> None:
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "fox"}], bad_words=["dog", "a b"])
    assert body.to_job().sampling_params()["bad_words"] == ["dog", "a b"] and not ignored_fields(body)


def test_a_batch_lines_answer_carries_the_served_name_it_asked_for(service_settings: Settings) -> None:
    for model in ALIASES:
        job = build_line(ApiKey(id="key_batch_test"), 1, {"custom_id": "a", "body": {"model": model, "prompt": "fox"}},
                         COMPLETIONS, "batch_test").job
        assert job is not None and answer_model(job) == model
    assert answer_model(Job(id="job_x", metadata_={})) == ALIASES[0]


def test_a_batch_line_names_the_field_as_its_endpoint_would(client: TestClient) -> None:
    line = {"custom_id": "a", "body": {"model": "tiny", "prompt": [5] * 200}}  # past the 128-token context
    result = build_line(ApiKey(id="key_batch_test"), 1, line, COMPLETIONS, "batch_test")
    assert result.job is None and result.error is not None and result.error["param"] == "prompt"


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
    def text(tokens: list[int]) -> str:
        return client.post("/detokenize", json={"tokens": tokens}, headers=auth_headers).json()["prompt"]

    assert text(with_prompt["tokens"]) == "<|im_start|>user\nthe fox<|im_end|>\n<|im_start|>assistant\n"
    assert text(without["tokens"]) == "<|im_start|>user\nthe fox<|im_end|>\n"


CONTINUED = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "It jumps "}]


def test_a_final_message_left_open_is_what_the_model_continues(
    client: TestClient, auth_headers: dict[str, str]
) -> None:
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True}
    tokens = client.post("/tokenize", json=body, headers=auth_headers).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": tokens}, headers=auth_headers).json()["prompt"]
    assert text == "<|im_start|>user\nthe fox<|im_end|>\n<|im_start|>assistant\nIt jumps "
    job = client.post("/v1/jobs", json={**body, "max_tokens": 2}, headers=auth_headers)
    assert job.status_code == 202 and job.json()["prompt"] == text
    chat = ChatCompletionRequest(model="tiny", max_tokens=2, **body).to_job()
    assert chat.chat_template_options().continue_final_message
    # the final message's text found where it ends, not where it also occurs ("end" in <|im_end|>); empty is open too
    model, options = prompt_model(), ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    for content in ("end", ""):
        rendered = model.render_chat([CONTINUED[0], {"role": "assistant", "content": content}], options=options)
        assert rendered == "<|im_start|>user\nthe fox<|im_end|>\n<|im_start|>assistant\n" + content
    hiding = dataclasses.replace(model, chat_template="{% for m in messages %}{{ m.role }}:{% endfor %}")
    with pytest.raises(PromptFieldError, match="does not show the final message") as caught:
        hiding.render_chat(CONTINUED, options=options)
    assert caught.value.field == "continue_final_message"
    trimming = dataclasses.replace(model, chat_template="{% for m in messages %}[{{ m.content | trim }}]{% endfor %}")
    assert trimming.render_chat(CONTINUED, options=options) == "[the fox][It jumps"


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_what_the_server_sets() -> None:
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[-1].content }}{{ 1 + offset }}"
    model = dataclasses.replace(prompt_model(), chat_template=template)
    messages = [{"role": "user", "content": "fox"}]
    assert model.render_chat(messages, options=ChatTemplateOptions(template_kwargs={"enable_thinking": True,
                                                                                   "offset": 1})) == "<think>fox2"
    for kwargs, field in (({"messages": [], "offset": 1}, "chat_template_kwargs.messages"),
                          ({"offset": "one"}, "messages")):  # the template's own failure on what it was given
        with pytest.raises(PromptFieldError) as caught:
            model.render_chat(messages, options=ChatTemplateOptions(template_kwargs=kwargs))
        assert caught.value.field == field


@pytest.mark.parametrize(("body", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt is true by default
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": "think"}, "chat_template_kwargs"),
])
@pytest.mark.parametrize("max_tokens", [None, 4])  # without max_tokens the context left is counted first
def test_bad_chat_template_options_are_400_naming_the_field(
    client: TestClient, auth_headers: dict[str, str], body: dict[str, Any], param: str, max_tokens: int | None
) -> None:
    request = {"model": "tiny", "messages": CONTINUED, "max_tokens": max_tokens, **body}
    assert _error(client.post("/v1/chat/completions", json=request, headers=auth_headers))["param"] == param
    if "messages" not in body:
        tokenize = {"messages": CONTINUED, **body}
        assert _error(client.post("/tokenize", json=tokenize, headers=auth_headers))["param"] == param


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


def test_a_completion_without_an_api_key_is_401_with_the_bearer_challenge(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_tokenize_for_an_unknown_model_is_404(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}, headers=auth_headers)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_completions_top_logprobs_hold_the_chosen_token_whatever_its_rank(client: TestClient) -> None:
    output = [{"index": 0, "text": "ab", "token_ids": [5, 6], "finish_reason": "length",
               "logprobs": [{"5": -2.0, "9": -0.5}, {"6": -0.1, "7": -3.0}]}]
    job = Job(id="job1", status=JobStatus.succeeded, params={"n": 1, "logprobs": 1}, metadata_={},
              created_at=datetime.now(UTC), prompt_tokens=1, completion_tokens=2, output=output)
    (choice,) = completion_body(job, "m")["choices"]
    # the likeliest token, and the sampled one where it is not: logprobs + 1 entries at most, as OpenAI
    assert [sorted(top.values()) for top in choice["logprobs"]["top_logprobs"]] == [[-2.0, -0.5], [-0.1]]
    assert choice["logprobs"]["token_logprobs"] == [-2.0, -0.1]


def test_an_assistants_refusal_part_is_history_the_template_reads() -> None:
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Why?"}]})
    assert request.messages[1].as_job_message() == {"role": "assistant", "content": "No."}
    with pytest.raises(ValidationError, match="refusal parts belong to assistant messages"):
        ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}]})


def test_text_parts_join_with_newlines_as_vllm_renders_them() -> None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]})
    assert request.messages[0].as_job_message() == {"role": "user", "content": "first\nsecond"}


def test_a_messages_name_reaches_the_chat_template(service_settings: Settings, auth_headers: dict[str, str]) -> None:
    template = "{% for m in messages %}{{ m.name or '-' }}:{{ m.content }};{% endfor %}"
    messages = [{"role": "user", "content": "hi", "name": "ada"}, {"role": "user", "content": "yo"}]
    try:
        with TestClient(create_app(service_settings.model_copy(update={"chat_template": template}))) as client:
            tokens = client.post("/tokenize", json={"messages": messages}, headers=auth_headers).json()["tokens"]
            text = client.post("/detokenize", json={"tokens": tokens}, headers=auth_headers).json()["prompt"]
            assert text == "ada:hi;-:yo;"
            job = client.post("/v1/jobs", json={"messages": messages, "max_tokens": 1}, headers=auth_headers)
            assert job.status_code == 202, job.text
            shown = client.get(f"/v1/jobs/{job.json()['id']}", headers=auth_headers).json()
            assert shown["messages"][0]["name"] == "ada"
            empty = client.post("/v1/jobs", json={"messages": [{**messages[0], "name": ""}]}, headers=auth_headers)
            assert empty.status_code == 422 and empty.json()["error"]["field"] == "messages.0.name"
    finally:
        configure(service_settings)


def test_tokenize_shows_the_tools_to_the_chat_template(
    service_settings: Settings, auth_headers: dict[str, str]
) -> None:
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}" \
               "{% endfor %}"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    try:
        with TestClient(create_app(service_settings.model_copy(update={"chat_template": template}))) as client:
            body = {"messages": [{"role": "user", "content": "the fox"}], "tools": [tool]}
            tokens = client.post("/tokenize", json=body, headers=auth_headers).json()["tokens"]
            text = client.post("/detokenize", json={"tokens": tokens}, headers=auth_headers).json()["prompt"]
            assert text == "[get_weather]the fox"
            bad = client.post("/tokenize", json={**body, "tools": [{"type": "function", "function": {"name": "a b"}}]},
                              headers=auth_headers)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.0.function.name"
    finally:
        configure(service_settings)


def test_the_built_in_model_answers_to_its_hugging_face_id_too() -> None:
    from core.model_files import BUILTIN_HF_IDS, DEFAULT_MODEL, converted_dir, model_names

    hf_id = BUILTIN_HF_IDS[DEFAULT_MODEL]
    assert model_names(DEFAULT_MODEL) == [DEFAULT_MODEL, hf_id] and model_names(hf_id) == [hf_id, DEFAULT_MODEL]
    assert converted_dir(hf_id) == converted_dir(DEFAULT_MODEL)  # `pagedserve up <hf id>` serves the built-in
    assert model_names("/models/other") == ["/models/other"]


@pytest.mark.parametrize(("error", "field"), [
    ("refused: allowed_token_ids holds only stop tokens (EOS or stop_token_ids), which min_tokens (2) holds back",
     "allowed_token_ids"),
    ("refused: structured_outputs.choice could not be followed: lexer error", "structured_outputs.choice"),
    ("refused: StructuredOutputError: structured_outputs.regex could not be followed: lexer error: too many "
     "expressions constructed", "structured_outputs.regex"),
    ("refused: invalid sampling parameters: n must be an integer between 1 and 64, got 99", "n"),
    ("refused: the engine could not place it", None),
    ("RuntimeError: worker crashed", None),
])
def test_a_refused_jobs_error_names_the_field_its_refusal_blames(error: str, field: str | None) -> None:
    from core.models import Job, JobStatus
    from core.openai_responses import job_failure

    failure = job_failure(Job(id="job_x", status=JobStatus.failed, error=error))
    assert failure is not None and failure.field == field
    assert failure.status_code == (400 if error.startswith("refused: ") else 500)


def test_a_refusal_names_the_field_as_the_client_sent_it() -> None:
    from api.errors import ApiError
    from api.openai_schemas import openai_named

    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "guided_choice": ["a", "b"], "max_tokens": 2})
    named = openai_named(ApiError(400, "structured_outputs.choice could not be followed", "structured_outputs.choice"),
                         request.sent_as())
    assert named.field == "guided_choice"


@pytest.mark.parametrize("text", ["café 🎉🔥", "the fox", "<|im_end|>"])
def test_a_tokens_bytes_are_its_own_where_it_holds_part_of_a_character(text: str) -> None:
    model = prompt_model()  # a byte-level vocabulary, as GPT-2's and SmolLM2's
    token_ids = model.tokenizer.encode(text).ids
    assert b"".join(model.token_bytes(token_id) for token_id in token_ids) == text.encode()
    job = Job(id="job_b", status=JobStatus.succeeded, params={"n": 1, "logprobs": 0}, metadata_={},
              created_at=datetime.now(UTC), prompt_tokens=1, completion_tokens=len(token_ids),
              output=[{"index": 0, "text": text, "token_ids": token_ids, "finish_reason": "stop",
                       "logprobs": [{str(token_id): -1.0} for token_id in token_ids]}])
    content = chat_body(job, "m")["choices"][0]["logprobs"]["content"]
    assert bytes(b for entry in content for b in entry["bytes"]) == text.encode()


def test_a_byte_fallback_piece_is_its_byte() -> None:
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<0xF0>": 1, "a": 2}
    model = dataclasses.replace(prompt_model(), tokenizer=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                byte_level=False)
    assert [model.token_bytes(i) for i in (1, 2)] == [b"\xf0", b"a"]
