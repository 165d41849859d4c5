"""Tool calls on /v1/chat/completions as vLLM makes them: forced (tool_choice "required" or a named function: the
constraint each builds) and automatic (tool_choice "auto" read by the server's tool-call parser); the 400s naming what
is wrong, the tools reaching the chat template, and a finished job's text answered as tool calls. The model runs in
tests/service/e2e/test_e2e_openai.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, get_args

import jsonschema
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.errors import ApiError
from api.openai_schemas import ChatCompletionRequest
from api.prompts import prompt_model
from core.models import Job, JobStatus
from core.openai_responses import (
    arguments_delta,
    chat_body,
    final_choices,
    streamed_call_name,
    streamed_content_filter,
    tool_call_deltas,
)
from core.settings import Settings, configure
from core.tool_calls import AUTO_PREFIX, NAMED_PREFIX, REQUIRED, call_schema, tool_calls
from core.tool_parsers import TOOL_CALL_PARSERS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def database_url(sqlite_url: str) -> str:
    """SQLite only: these checks answer before any job runs."""
    return sqlite_url


def _request(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=None, messages=MESSAGES, max_tokens=32, **extra)


def test_a_named_function_constrains_the_output_to_its_parameters() -> None:
    job = _request(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    job_create = job.to_job()
    assert job_create.metadata is not None and job_create.metadata["openai_tool_choice"] == NAMED_PREFIX + "get_weather"
    assert job_create.sampling_params()["structured_outputs"] == {"json": WEATHER["function"]["parameters"]}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_the_output_to_calls_of_the_tools(parallel: bool) -> None:
    spec = _request(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=parallel).to_job()
    schema = spec.sampling_params()["structured_outputs"]["json"]
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good[:1], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "launch", "parameters": {}}],
                [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate(good, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good, schema)


def test_auto_without_a_parser_is_refused_naming_tool_choice_as_vllm_does() -> None:
    with pytest.raises(ApiError, match="--tool-call-parser") as refused:
        _request(tools=[WEATHER], tool_choice="auto").to_job()
    assert refused.value.field == "tool_choice"


@pytest.mark.parametrize("choice", [None, "none"])
def test_auto_and_none_leave_the_output_free_and_show_the_tools(choice: str | None) -> None:
    job = _request(tools=[WEATHER], tool_choice=choice).to_job()
    assert job.sampling_params()["structured_outputs"] is None and "openai_tool_choice" not in (job.metadata or {})
    assert job.tools is not None and job.tools[0].function.name == "get_weather"


def test_the_tools_reach_a_chat_template_that_shows_them(client: TestClient, auth_headers: dict[str, str]) -> None:
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    model = dataclasses.replace(prompt_model(), chat_template=template)
    assert model.render_chat(MESSAGES, tools=[WEATHER, CLOCK]) == "TOOLS:get_weather;get_time;Weather in Paris?"
    assert model.render_chat(MESSAGES) == "Weather in Paris?"
    body = {"messages": MESSAGES, "max_tokens": 4, "tools": [WEATHER]}
    response = client.post("/v1/jobs", json=body, headers=auth_headers)
    assert response.status_code == 202, response.text


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
    ({"tools": [CLOCK, {"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_a_bad_tool_request_is_400_naming_the_field(
    client: TestClient, auth_headers: dict[str, str], extra: dict[str, Any], param: str
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, **extra}
    response = client.post("/v1/chat/completions", json=body, headers=auth_headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error


def test_tools_on_the_job_api_need_messages(client: TestClient, auth_headers: dict[str, str]) -> None:
    response = client.post("/v1/jobs", json={"prompt": "x", "tools": [WEATHER]}, headers=auth_headers)
    assert response.status_code == 422 and "tools are rendered by the chat template" in response.text


def _job(mode: str, outputs: list[tuple[str, str]]) -> Job:
    return Job(id="job1", status=JobStatus.succeeded, params={"n": len(outputs), "logprobs": None},
               metadata_={"openai_tool_choice": mode}, created_at=datetime.now(UTC), prompt_tokens=5,
               completion_tokens=9, output=[{"index": i, "text": text, "token_ids": [], "finish_reason": reason}
                                            for i, (text, reason) in enumerate(outputs)])


def test_a_finished_job_answers_with_its_tool_calls_and_a_cut_off_one_with_its_text() -> None:
    calls = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    job = _job(REQUIRED, [(json.dumps(calls), "stop"), ('[{"name": "get_wea', "length")])
    first, cut = chat_body(job, "m")["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c["id"] for c in first["message"]["tool_calls"]}) == 2
    assert cut["finish_reason"] == "length" and cut["message"] == {"role": "assistant", "content": '[{"name": "get_wea'}
    assert chat_body(job, "m") == chat_body(job, "m")  # the same ids every time the job is read
    deltas = tool_call_deltas(job, 0, {})
    assert deltas[0]["delta"]["tool_calls"][1]["function"]["name"] == "get_time"
    assert deltas[1]["delta"] == {"content": '[{"name": "get_wea'}
    assert [c["finish_reason"] for c in final_choices(job, "/v1/chat/completions")] == ["tool_calls", "length"]


def test_a_named_calls_stream_closes_with_the_arguments_not_yet_sent() -> None:
    job = _job(NAMED_PREFIX + "get_weather", [('{"city": "Rome"}', "stop"), ('{"city": "Ro', "length"),
                                               ('{"city": "Oslo"}', "stop")])
    content_filter = streamed_content_filter(job)  # all of the text is sent as it comes, as arguments
    assert streamed_call_name(job) == "get_weather" and content_filter is not None and content_filter('{"ci') == 4
    opening = arguments_delta(job, 2, '{"ci', first=True)["tool_calls"][0]
    assert opening == {"index": 0, "id": chat_body(job, "m")["choices"][2]["message"]["tool_calls"][0]["id"],
                       "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}
    # choice 0 was sent whole, 1 (cut off by max_tokens) in part, 2 not at all (its token events were lost)
    rest, whole = tool_call_deltas(job, 0, {0: len('{"city": "Rome"}'), 1: 3, 2: 0})
    assert rest == {"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ity": "Ro'}}]},
                    "finish_reason": None}
    assert whole["index"] == 2 and whole["delta"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert streamed_call_name(_job(REQUIRED, [("[]", "stop")])) is None


def test_a_named_call_cut_short_by_a_stop_string_is_answered_as_its_text() -> None:
    job = _job(NAMED_PREFIX + "get_weather", [('{"city": "', "stop")])  # stop: ["Paris"] ended it mid-arguments
    (choice,) = chat_body(job, "m")["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"] == {"role": "assistant", "content": '{"city": "'}


def test_a_named_call_takes_the_whole_text_as_its_arguments() -> None:
    content, (call,) = tool_calls(NAMED_PREFIX + "get_weather", '{"city": "Rome"}', "call_x_")  # type: ignore[misc]
    assert content is None
    assert call == {"id": "call_x_0", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert call_schema([WEATHER], NAMED_PREFIX + "get_weather", True) == WEATHER["function"]["parameters"]


@pytest.fixture
def auto_tool_choice(service_settings: Settings) -> Iterator[None]:
    """The server started with --enable-auto-tool-choice --tool-call-parser hermes."""
    configure(service_settings.model_copy(update={"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}))
    yield
    configure(service_settings)


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_with_a_parser_leaves_the_output_free_and_keeps_special_tokens(auto_tool_choice: None,
                                                                           choice: str | None) -> None:
    job = _request(tools=[WEATHER], tool_choice=choice).to_job()
    assert job.metadata is not None and job.metadata["openai_tool_choice"] == AUTO_PREFIX + "hermes"
    params = job.sampling_params()
    assert params["structured_outputs"] is None and params["skip_special_tokens"] is False
    # what the client asks for stands; without tools, or with "none", there is nothing to parse
    assert _request(tools=[WEATHER], skip_special_tokens=True).to_job().sampling_params()["skip_special_tokens"]
    for request in (_request(), _request(tools=[WEATHER], tool_choice="none")):
        job = request.to_job()
        assert "openai_tool_choice" not in (job.metadata or {}) and job.sampling_params()["skip_special_tokens"]


def test_forced_tool_choice_stays_forced_with_a_parser(auto_tool_choice: None) -> None:
    job = _request(tools=[WEATHER], tool_choice="required").to_job()
    assert job.metadata is not None and job.metadata["openai_tool_choice"] == REQUIRED
    assert job.sampling_params()["structured_outputs"] is not None


def test_auto_takes_a_constraint_of_its_own(auto_tool_choice: None) -> None:
    job = _request(tools=[WEATHER], response_format={"type": "json_object"}).to_job()
    assert job.sampling_params()["structured_outputs"] == {"json_object": True}


def test_auto_tool_choice_needs_a_parser() -> None:
    with pytest.raises(ValidationError, match="--tool-call-parser"):
        Settings(enable_auto_tool_choice=True)
    assert set(get_args(get_args(Settings.model_fields["tool_call_parser"].annotation)[0])) == set(TOOL_CALL_PARSERS)


HERMES_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_finished_auto_job_answers_with_the_calls_its_parser_reads_and_the_content_before_them() -> None:
    job = _job(AUTO_PREFIX + "hermes", [(HERMES_TEXT, "stop"), ("Just words.", "stop"), (HERMES_TEXT, "length")])
    called, plain, cut = chat_body(job, "m")["choices"]
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] == "Let me look.\n"
    (call,) = called["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert plain == {**plain, "finish_reason": "stop", "message": {"role": "assistant", "content": "Just words."}}
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == HERMES_TEXT
    # a stream sent the content before the call as it came: the end carries the call, or the text still held
    deltas = tool_call_deltas(job, 0, {0: len("Let me look.\n"), 1: 4, 2: 0})
    assert [d["delta"] for d in deltas[1:]] == [{"content": " words."}, {"content": HERMES_TEXT}]
    assert list(deltas[0]["delta"]) == ["tool_calls"]
    assert deltas[0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    # token events lost on the way: the content not yet sent comes with the calls; a choice all sent, not at all
    (gap, rest) = tool_call_deltas(job, 0, {0: 3, 1: len("Just words."), 2: 0})
    assert gap["delta"]["content"] == "Let me look.\n"[3:] and gap["delta"]["tool_calls"]
    assert rest["index"] == 2


def test_parallel_tool_calls_false_answers_with_a_parsers_first_call_alone(auto_tool_choice: None) -> None:
    two = HERMES_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    answers = {}
    for parallel in (True, False):
        request = _request(tools=[WEATHER, CLOCK], parallel_tool_calls=parallel).to_job()
        stored = _job(AUTO_PREFIX + "hermes", [(two, "stop")])
        stored.metadata_ = request.metadata
        (choice,) = chat_body(stored, "m")["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look.\n"
        answers[parallel] = [c["function"]["name"] for c in choice["message"]["tool_calls"]]
        (delta,) = tool_call_deltas(stored, 0, {0: len("Let me look.\n")})  # a stream's end: the same calls
        assert [c["function"]["name"] for c in delta["delta"]["tool_calls"]] == answers[parallel]
    assert answers == {True: ["get_weather", "get_time"], False: ["get_weather"]}


def test_a_parsed_call_of_a_function_not_offered_is_answered_as_content(auto_tool_choice: None) -> None:
    job = _request(tools=[WEATHER, CLOCK]).to_job()
    assert job.metadata is not None and job.metadata["openai_tool_names"] == "get_weather,get_time"
    rogue = HERMES_TEXT.replace("get_weather", "launch_missiles")
    stored = _job(AUTO_PREFIX + "hermes", [(HERMES_TEXT, "stop"), (rogue, "stop")])
    stored.metadata_ = job.metadata
    offered, not_offered = chat_body(stored, "m")["choices"]
    assert offered["finish_reason"] == "tool_calls"
    assert not_offered["finish_reason"] == "stop" and not_offered["message"] == {"role": "assistant", "content": rogue}
    calls, held = tool_call_deltas(stored, 0, {0: len("Let me look.\n"), 1: 0})  # the held text comes as content
    assert list(calls["delta"]) == ["tool_calls"] and held["delta"] == {"content": rogue}


def test_parsers_whose_markers_are_special_tokens_keep_them(service_settings: Settings) -> None:
    for parser, keeps in (("hermes", True), ("mistral", True), ("granite", True), ("llama3_json", False),
                          ("pythonic", False)):
        configure(service_settings.model_copy(update={"enable_auto_tool_choice": True, "tool_call_parser": parser}))
        try:
            job = _request(tools=[WEATHER]).to_job()
        finally:
            configure(service_settings)
        assert job.metadata is not None and job.metadata["openai_tool_choice"] == AUTO_PREFIX + parser
        assert job.sampling_params()["skip_special_tokens"] is not keeps
